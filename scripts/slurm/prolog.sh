#!/bin/bash
# Slurm Prolog= (runs as root on every node of the allocation before the job; use
# PrologFlags=Alloc so it runs at allocation time on all nodes). A job that asks for a mount,
#   #SBATCH --comment=fanstore:/shared/imagenet.fanstore,stage_out=/shared/$USER/run42
# gets it mounted at /tmp/fanstore-$SLURM_JOB_ID on every node, owned by the job user, before its
# first step starts; jobs that ask for nothing are left alone. Exit 0 = mounted (or nothing
# asked); non-zero = the mount failed and was cleaned up (Slurm drains the node and requeues
# the job). See docs/slurm.md.
#
# Site settings (optional) come from fanstore-fuse.env next to slurm.conf (the prolog's
# $SLURM_CONF; /etc/slurm/fanstore-fuse.env by default), a shell file of VAR=value lines:
# FANSTORE_FUSE (the CLI), FANSTORE_RENDEZVOUS_DIR (a shared directory), FANSTORE_JOB_DIR,
# FANSTORE_MOUNT_BASE, FANSTORE_LOCAL_BASE, FANSTORE_PROLOG_TIMEOUT, and UCX_TLS or
# FI_PROVIDER for MPI between nodes. See docs/slurm.md.
conf=${FANSTORE_SLURM_ENV:-$(dirname "${SLURM_CONF:-/etc/slurm/slurm.conf}")/fanstore-fuse.env}
if [[ -r "$conf" ]]; then set -a; . "$conf"; set +a; fi
here=$(dirname "$(readlink -f "$0")")
cli=${FANSTORE_FUSE:-$(command -v fanstore-fuse || echo "$here/../../.venv/bin/fanstore-fuse")}
exec "$cli" slurm-prolog
