#!/bin/bash
# SLURM epilog snippet (every node, after the job): a backstop if the job did not unmount,
# e.g. because it was cancelled or hit its time limit.
MNT="/tmp/fanstore-$SLURM_JOB_ID"
if command -v fanstore-fuse >/dev/null 2>&1; then
  fanstore-fuse umount "$MNT" --timeout 10 || true
fi
grep -q " $MNT fuse" /proc/mounts && fusermount3 -u -z "$MNT" || true
# (lead) no pkill by pattern: on the one-host test cluster it SIGTERMs every fanstore daemon on the
# machine, other jobs' and other users' too (issue 10). Cleanup by recorded pid only.
rm -rf "/tmp/fanstore-local-$SLURM_JOB_ID" "$MNT"
