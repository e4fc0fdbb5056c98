"""``step.piece.InputSpec``: the stand-ins a piece is compiled again on at step 3, once the
inputs it was first compiled with are gone. Reference: the original inputs' layout."""
import gc

import pytest
import torch
import torch.distributed as dist

from lynx_compile.step.piece import InputSpec


def test_plain_tensor_stands_in_with_its_layout_and_a_live_parameter_is_itself():
    x = torch.randn(4, 6).t().requires_grad_(True)  # a non-contiguous activation
    w = torch.nn.Parameter(torch.randn(3))
    spec = InputSpec([x, w, 7])
    shape, stride = tuple(x.shape), x.stride()
    del x
    gc.collect()
    x2, w2, seven = spec.inputs()
    assert (tuple(x2.shape), x2.stride(), x2.requires_grad) == (shape, stride, True)
    assert w2 is w and seven == 7


@pytest.mark.timeout(60)
def test_dtensor_with_an_unwaited_local_shard_stands_in_as_one(tmp_path):
    """Sequence-parallel TP hands block 0 a DTensor whose local shard is an unwaited
    ``AsyncCollectiveTensor``; the stand-in must be one too, else the compile again makes code
    that reads the wrapper's null data pointer (a segfault, torchtitan TP at a budget)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = AsyncCollectiveTensor(torch.randn(2, 8, 4))
        d = DTensor.from_local(local, mesh, (Shard(1),), run_check=False).requires_grad_(True)
        plain = DTensor.from_local(torch.randn(4, 4), mesh, (Shard(0),), run_check=False)
        spec = InputSpec([d, plain])
        del d, plain, local
        gc.collect()
        s1, s2 = spec.inputs()
        assert isinstance(s1, DTensor) and isinstance(s1._local_tensor, AsyncCollectiveTensor)
        assert (tuple(s1.shape), s1.placements, s1.device_mesh, s1.requires_grad) == ((2, 8, 4), (Shard(1),), mesh, True)
        assert isinstance(s2, DTensor) and type(s2._local_tensor) is torch.Tensor
        assert (tuple(s2.shape), s2.placements) == ((4, 4), (Shard(0),))
    finally:
        dist.destroy_process_group()
