"""Batch jobs: `hpcbert submit` renders PBS Pro / Torque / Slurm scripts from templates and submits them."""
