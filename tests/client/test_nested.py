"""tqtx.client.nested: the direct jagged constructor gives what torch's public call gives."""
from __future__ import annotations

import pytest
import torch

from tqtx.client import nested


@pytest.mark.parametrize("lengths,rest", [([3], ()), ([1, 0, 4, 2], (3,)), ([0, 0], (2,)),
                                          ([5, 5, 5], ()), ([], (2,))])
def test_direct_and_public_agree(lengths, rest):
    values = torch.arange(sum(lengths) * (rest[0] if rest else 1), dtype=torch.float64)
    values = values.reshape(sum(lengths), *rest)
    offsets = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])
    a = nested._direct(values, offsets, lengths)
    b = nested.public(values, offsets, lengths)
    assert type(a) is type(b) and a.shape == b.shape and a.layout == torch.jagged
    assert a.values().data_ptr() == values.data_ptr()  # a view, no copy
    assert [x.tolist() for x in a.unbind()] == [x.tolist() for x in b.unbind()]
    if lengths:
        assert (a._min_seqlen, a._max_seqlen) == (min(lengths), max(lengths))
        assert torch.equal(torch.nested.to_padded_tensor(a, -1.0),
                           torch.nested.to_padded_tensor(b, -1.0))
        # padded to the longest row, not to every value together
        assert torch.nested.to_padded_tensor(a, 0.0).shape[1] == max(lengths)


def test_this_torch_takes_the_direct_constructor():
    assert nested.jagged.usable()
    nested.jagged(torch.zeros(2), torch.tensor([0, 2]), [2])
    assert nested.jagged.taken is True


def test_without_the_internal_constructor_the_public_call_is_used(monkeypatch):
    def broken(values, offsets, lengths):
        raise TypeError("this torch's constructor takes other arguments")
    monkeypatch.setattr(nested.jagged, "direct", broken)
    monkeypatch.setattr(nested.jagged, "taken", None)
    assert not nested.jagged.usable()
    nt = nested.jagged(torch.arange(3.0), torch.tensor([0, 1, 3]), [1, 2])
    assert nested.jagged.taken is False
    assert [x.tolist() for x in nt.unbind()] == [[0.0], [1.0, 2.0]]
