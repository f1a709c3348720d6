"""Reports over run directories: statistics of repeated measurements and comparisons of runs."""
