"""Reports: what the commands print and write. Terminal tables, PNG figures through
matplotlib (the `plots` extra; without it a figure is skipped with a logged line), and
the JSON record every benchmark writes."""
