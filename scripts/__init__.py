"""The user's entry points (run as files: pretrain_gpt.py, prepare_data.py, run.sh, slurm/) and
``scripts.bench``, the benchmark package (run as modules: ``python -m scripts.bench.<name>``)."""
