"""For trainers: hand new weights to an engine. `share_tensors` packs named tensors into
one buffer the engine opens without pickle (CPU shared memory or a CUDA IPC buffer);
pass its `.spec` to `update_weights_from_tensor` and keep it open until that returns.
`init_update_group` joins the group a trainer broadcasts over, as rank 0, while the
engine joins with `init_weights_update_group`; then `update_weights_from_distributed`.
See docs/control.md. Importing it imports torch."""

from sgl.transports.tensors import (
    SharedBuffer,
    UpdateGroup,
    check_spec,
    init_update_group,
    open_shared,
    share_tensors,
)

__all__ = ["SharedBuffer", "UpdateGroup", "check_spec", "init_update_group", "open_shared", "share_tensors"]
