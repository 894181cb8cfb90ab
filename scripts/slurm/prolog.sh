#!/bin/bash
# SLURM prolog snippet (runs as root on every node before the job): make room for the mount.
# Nothing is mounted here: the job's own `fanstore-fuse mount` does that, as the job user.
mkdir -p "/tmp/fanstore-$SLURM_JOB_ID" "/tmp/fanstore-local-$SLURM_JOB_ID"
chown "$SLURM_JOB_USER" "/tmp/fanstore-$SLURM_JOB_ID" "/tmp/fanstore-local-$SLURM_JOB_ID"
