#!/bin/bash
# SLURM epilog snippet (every node, after the job): a backstop if the job did not unmount,
# e.g. because it was cancelled or hit its time limit.
MNT="/tmp/fanstore-$SLURM_JOB_ID"
if command -v fanstore-fuse >/dev/null 2>&1; then
  fanstore-fuse umount "$MNT" --timeout 10 || true
fi
grep -q " $MNT fuse" /proc/mounts && fusermount3 -u -z "$MNT" || true
pkill -u "$SLURM_JOB_USER" -f "fanstore_fuse mount" || true
rm -rf "/tmp/fanstore-local-$SLURM_JOB_ID" "$MNT"
