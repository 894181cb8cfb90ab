/* Directory listings answered with plain READDIR where the kernel allows (issue 14): not yet
 * patched. */
#include "_shim_ops.h"

void fanstore_patch_readdir(struct fuse_lowlevel_ops *ops) { (void)ops; }
