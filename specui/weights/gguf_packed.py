"""A GGUF of 4-bit blocks loaded onto the 4-bit kernels without a float copy of its matrices.

transformers reads a GGUF by dequantizing every tensor to float32 and holding them all before the
model takes them: about 7 bytes a parameter at the peak once w4a8 repacks them
(specui/weights/load_memory.py), so a 3B Q4_0 file wanted 21 GiB and a 7B one 50. Here the model is
built empty (accelerate's `init_empty_weights`), each tensor that is not a decoder matrix
(embeddings, norms, the head, biases) is dequantized and put in place one at a time, and every
decoder matrix is left unbuilt (one zero broadcast to its shape, quantize.unbuilt): its Q4_0 / Q4_1
/ Q4_K blocks are decoded into int4 groups only when the kernel packs that matrix (FileGroups), then
dropped; on w4a8 its matrices in more than 4 bits (a Q4_K_M file's Q6_K ones) are likewise
dequantized one at a time as the kernel puts them on 8-bit groups (FileMatrices). The names and the
row order of each tensor are transformers' own (its GGUF name map and tensor processor: llama's
query/key rows un-permuted), found by passing row indices through the processor, so the model equals
the one transformers builds."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from specui.errors import SpecUIError
from specui.weights.gguf_blocks import Groups, decode_tensor, dequantized, eight_bit_matrix, four_bit_matrix


class _FromFile(Mapping):
    """Tensors of a memory-mapped GGUF by transformers module name, decoded when read (nothing held):
    module name -> (the reader's tensor, its row order or None). Membership never decodes."""

    def __init__(self, tensors: dict[str, tuple[object, np.ndarray | None]]) -> None:
        self._tensors = tensors

    def __contains__(self, name: object) -> bool:  # Mapping's own would decode the tensor to answer
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class FileGroups(_FromFile):
    """A GGUF's 4-bit decoder matrices, each decoded into int4 groups (rows in transformers' order)."""

    def __getitem__(self, name: str) -> Groups:
        tensor, rows = self._tensors[name]
        q, scale, low = decode_tensor(tensor)
        if rows is None:
            return q, scale, low
        order = torch.from_numpy(rows)
        return q[order].contiguous(), scale[order].contiguous(), low[order].contiguous()


class FileMatrices(_FromFile):
    """A GGUF's decoder matrices in more than 4 bits (gguf_blocks.EIGHT_BIT), each dequantized to
    float32 (rows in transformers' order), for w4a8 to put on 8-bit groups one at a time."""

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor, rows = self._tensors[name]
        weight = torch.from_numpy(np.asarray(dequantized(tensor), dtype=np.float32))
        return weight if rows is None else weight[torch.from_numpy(rows)].contiguous()


def packed_params(reader, wide: bool = False) -> int:
    """Parameters of a GGUF's 4-bit decoder matrices (the part this path never holds in float), and
    with `wide` (w4a8) those it holds on 8-bit groups too."""
    return sum(int(t.n_elements) for t in reader.tensors if four_bit_matrix(t) or (wide and eight_bit_matrix(t)))


def _processor(reader, config):
    """transformers' tensor processor for the file's architecture (llama's un-permutes q / k rows)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

    architecture = read_field(reader, "general.architecture")[0]
    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


def _row_order(processor, tensor, rows: int) -> np.ndarray | None:
    """Row i of transformers' weight is row order[i] of the file's (None: the file's order)."""
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    moved = np.asarray(processor.process(weights=index, name=tensor.name).weights).reshape(-1)
    return None if np.array_equal(moved, index.reshape(-1)) else moved.copy()


def _put(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if leaf in module._parameters:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def load_packed(where: str, gguf: str, reader, dtype: torch.dtype, trust_remote_code: bool = False,
                progress: Callable[[int, int], None] | None = None,
                wide: bool = False) -> tuple[torch.nn.Module, FileGroups, FileMatrices]:
    """(the model, its decoder matrices unbuilt; their groups by module name; its matrices in more than
    4 bits, unbuilt too with `wide` (w4a8 holds them on 8-bit groups), else none: they are put in place)
    of the GGUF `where`/`gguf` (`reader`: its open reader); the other tensors in `dtype`. `progress(done,
    total)` as each tensor starts. A file that leaves one of the model's tensors unset is refused."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    config = AutoConfig.from_pretrained(where, gguf_file=gguf, trust_remote_code=trust_remote_code,
                                        local_files_only=True)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    processor = _processor(reader, config)
    names = get_gguf_hf_weights_map(model, processor)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    matrices: dict[str, tuple[object, np.ndarray | None]] = {}
    eight_bit: dict[str, tuple[object, np.ndarray | None]] = {}
    for done, tensor in enumerate(reader.tensors):
        if progress is not None:
            progress(done, len(reader.tensors))
        name = names.get(tensor.name)
        if name is None or name not in shapes:
            continue
        shape = shapes[name]
        left = matrices if four_bit_matrix(tensor) else eight_bit if wide and eight_bit_matrix(tensor) else None
        if left is not None and len(shape) == 2 and tuple(reversed(tensor.shape.tolist())) == shape:
            left[name.removesuffix(".weight")] = (tensor, _row_order(processor, tensor, shape[0]))
            _put(model, name, torch.zeros((), dtype=dtype).expand(shape))
            continue
        processed = processor.process(weights=dequantized(tensor), name=tensor.name)
        value = torch.from_numpy(np.array(processed.weights, dtype=np.float32))
        if tuple(value.shape) != shape:
            raise SpecUIError(f"the GGUF's tensor {tensor.name} has shape {tuple(value.shape)}, "
                              f"but the model's {name} is {shape}")
        _put(model, name, value.to(dtype))
    if getattr(model.config, "tie_word_embeddings", False) or getattr(model.config.get_text_config(),
                                                                     "tie_word_embeddings", False):
        model.tie_weights()
    unset = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if unset:
        raise SpecUIError(f"the GGUF has no tensor for {len(unset)} of the model's weights (e.g. {unset[0]})")
    # the file it came from, as from_pretrained records its source: what its measurements are cached under
    # (engine.measure.model_identity), so two files of one architecture never share a cost profile
    model.name_or_path = model.config._name_or_path = str(Path(where) / gguf)
    return model, FileGroups(matrices), FileMatrices(eight_bit)
