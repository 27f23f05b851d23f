"""Measurements: selection speed, wire size, end-to-end step time against peers."""
