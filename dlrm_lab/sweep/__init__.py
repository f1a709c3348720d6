"""Resumable sweeps: a grid of train or infer experiments, each point repeated, in one directory.

The grid file and its points (`sweep.grid`), running every point-repeat in its own process and resuming after a kill
(`sweep.run`), what each point-repeat came to (`sweep.results`) and the tables rebuilt from them (`sweep.tables`).
"""
