#!/bin/bash
# Slurm Epilog= (runs as root on every node after the job). Unmounts the mount the prolog made
# for THIS job only (never other jobs' or users' mounts), as the job user: written files are
# staged out (verified) to the job's stage_out directory first; the local copy is removed only
# after that. If anything could not be saved it stays on the node, the reason and place are
# logged in $FANSTORE_JOB_DIR/job-$SLURM_JOB_ID.log, and the epilog exits 1 (Slurm drains the
# node so an admin can run `fanstore-fuse recover`). A job-script mode mount left at
# /tmp/fanstore-$SLURM_JOB_ID is unmounted the same way. Settings: see prolog.sh.
conf=${FANSTORE_SLURM_ENV:-$(dirname "${SLURM_CONF:-/etc/slurm/slurm.conf}")/fanstore-fuse.env}
if [[ -r "$conf" ]]; then set -a; . "$conf"; set +a; fi
here=$(dirname "$(readlink -f "$0")")
cli=${FANSTORE_FUSE:-$(command -v fanstore-fuse || echo "$here/../../.venv/bin/fanstore-fuse")}
exec "$cli" slurm-epilog
