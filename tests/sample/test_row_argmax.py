"""row_argmax is torch.argmax(dim=-1), first maximum and NaN rule included, on every input it takes."""

import pytest
import torch

from pagellm.sample.argmax import row_argmax


@pytest.mark.parametrize("shape", [(7,), (1, 32000), (5, 49152), (3, 4, 1000)])
def test_random_rows_equal_torch(shape: tuple[int, ...]) -> None:
    values = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    result = row_argmax(values)
    assert result.dtype is torch.int64
    assert torch.equal(result, values.argmax(dim=-1))


def test_ties_nans_and_infinities_follow_torch() -> None:
    nan, inf = float("nan"), float("inf")
    values = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0],  # a tie: the first
            [nan, 1.0, 2.0, 0.0],  # a NaN is the maximum
            [1.0, nan, 5.0, nan],  # the first NaN
            [-inf, -inf, -inf, -inf],  # all masked: index 0
            [-inf, -inf, 0.5, inf],
        ]
    )
    assert row_argmax(values).tolist() == values.argmax(dim=-1).tolist() == [1, 0, 1, 0, 3]


def test_strided_and_other_dtypes() -> None:
    values = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    assert torch.equal(row_argmax(values[::2, 10:]), values[::2, 10:].argmax(dim=-1))
    assert torch.equal(row_argmax(values.t()), values.t().argmax(dim=-1))
    as_bf16 = values.to(torch.bfloat16)  # torch's own argmax
    assert torch.equal(row_argmax(as_bf16), as_bf16.argmax(dim=-1))
    assert torch.equal(row_argmax(values[0]), values[0].argmax())  # one row: a 0-d index
