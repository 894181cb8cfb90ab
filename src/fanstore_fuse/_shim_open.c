/* OPEN and RELEASE of unmodified dataset files answered in C (issue 11): not yet patched. */
#include "_shim_ops.h"

void fanstore_patch_open(struct fuse_lowlevel_ops *ops) { (void)ops; }
