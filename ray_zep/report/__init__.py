"""Reports: PNG images drawn without plotting libraries, tables for the terminal."""
