"""``Buffers``: a backend's named metadata tensors (tables, lengths, workspaces), handed out
as views of flat storage that stays put once CUDA graphs are set up."""

from __future__ import annotations

import math

import torch

from .errors import InvalidInputError

__all__ = ["Buffers"]


class Buffers:
    """Named metadata tensors, handed out as views of flat storage.

    Eager mode grows a buffer when a batch needs more room (fresh buffers are zeroed). After
    ``freeze()`` (CUDA-graph mode, called by ``init_cuda_graph_state`` once every buffer was
    sized for ``max_bs``) a buffer never moves, so a captured graph keeps reading the memory
    the replay refills; asking for more than it holds is an ``InvalidInputError``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.fixed = False
        self._flat: dict[str, torch.Tensor] = {}

    def freeze(self) -> None:
        self.fixed = True

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.int32,
            ) -> torch.Tensor:
        n = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.dtype != dtype or flat.numel() < n:
            if self.fixed and flat is not None:
                raise InvalidInputError(f"buffer {name!r}", f"at most {flat.numel()} entries "
                                        "(sized by init_cuda_graph_state)", n)
            flat = torch.zeros(max(n, 1), dtype=dtype, device=self.device)
            self._flat[name] = flat
        return flat[:n].view(shape)

    def data_ptr(self, name: str) -> int:
        return self._flat[name].data_ptr()
