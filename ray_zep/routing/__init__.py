"""Routing layer: inter-node ring transfers spread over every NIC through proxy ranks."""
