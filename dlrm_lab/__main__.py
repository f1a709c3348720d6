from dlrm_lab.cli import run

run()
