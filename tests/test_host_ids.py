"""A forward's ids and positions written into kept CPU tensors (engine/host_ids.py): each call gives
what `torch.tensor([values])` would, in a tensor of the kind that call would have made (an inference
tensor in inference mode, which a compiled forward's guards tell apart), kept per length."""

import torch

from specui.engine.host_ids import HostIds


def test_rows_equal_torch_tensor_and_are_kept_per_length_and_mode():
    host = HostIds(most=8)
    for inference in (False, True, False):
        with torch.inference_mode(inference):
            seen = {}
            for values in ([5], [1, 2, 3], range(40, 48), [7], [9, 9, 9], [0]):
                row = host.row(values)
                want = torch.tensor([list(values)], dtype=torch.long)
                assert torch.equal(row, want) and row.dtype == want.dtype and row.shape == want.shape
                assert row.is_inference() == want.is_inference() == inference
                assert row.is_contiguous() and row.device.type == "cpu"
                if len(values) in seen:
                    assert row is seen[len(values)]  # the same tensor, refilled
                seen[len(values)] = row
    with torch.inference_mode():
        assert host.row([4]) is not host.row([4, 4])[:, :1]  # one tensor per length


def test_lengths_past_the_most_get_a_new_tensor_each_call():
    host = HostIds(most=2)
    a, b = host.row([1, 2, 3]), host.row([4, 5, 6])
    assert a is not b
    assert a.tolist() == [[1, 2, 3]] and b.tolist() == [[4, 5, 6]]
    assert host.row([]).shape == (1, 0)
