"""A loaded model's tensors as they run, kept on disk: the second load of a file reads them back instead of converting.

Converting a GGUF file is most of a short answer's start: on a 2-core AVX2 machine, SmolLM2's Q4_1 blocks unpacked
and repacked for torch's int4 kernel, its Q8_0 head as int4 halves and its embedding dequantized take ~2.4 s of the
first command's ~5 s after `import torch`; the same tensors read back from a safetensors file, memory-mapped, 0.02 s
(dev/LOG.md).

An entry is one safetensors file holding every parameter and buffer of the finished model but the RoPE tables
(Transformer.reset_rope remakes them), in their kernels' layouts, and in its metadata each Int4Linear's layout. It is
named by a key over everything those tensors depend on: the file (real path, size, modification time), the dtype, the
device, the load's quantization request, torch's version, the CPU kernels it dispatches, and the source of the
modules that convert and pack them (SOURCES), so that a change to any of them is a new key, never a stale hit. The
model's structure is still built from the file (its header: ~0.2 s), so the entry only has to fill it; one that does
not fit it exactly, or cannot be read, is a miss. A miss loads as usual and then writes the entry (a temporary file,
renamed: never half an entry), removing entries of files that changed or are gone, and all but the newest KEEP of the
file's own. Writing copies the tensors once more in memory (safetensors serializes them whole).
"""
import dataclasses
import hashlib
import importlib.util
import json
import os
import sys

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from quantize import Int4Linear

# The modules whose code decides a loaded model's tensors: their source is part of every key.
SOURCES = ("config", "formats.checkpoint", "formats.gguffile", "formats.parts", "formats.weightcache", "load", "model",
           "ops.gemv", "ops.qkernels", "quantize")
KEEP = 2  # entries kept per source file (other dtypes or quantization requests), newest first
SUFFIX = ".safetensors"


def default_dir() -> str:
    """$XDG_CACHE_HOME/tinyllm, else ~/.cache/tinyllm."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tinyllm")


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def code_hash() -> str:
    """A hash of SOURCES' files, found where the import system finds them (so a moved module is still hashed)."""
    h = hashlib.sha256()
    for name in SOURCES:
        with open(importlib.util.find_spec(name).origin, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def source_state(path: str) -> dict:
    """What identifies the file's contents without reading them: its real path, size and modification time."""
    st = os.stat(path)
    return {"source": os.path.realpath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


@dataclasses.dataclass
class Entry:
    """The cache entry of one load: its key and file."""
    directory: str
    key: dict
    file: str

    @classmethod
    def of(cls, directory: str, path: str, device: torch.device, dtype: torch.dtype, request) -> "Entry":
        """request: load.Quantization (the quantization asked for)."""
        key = {**source_state(path), "dtype": str(dtype), "device": device.type, "request": dataclasses.asdict(request),
               "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(), "code": code_hash()}
        name = f"{sha(key['source'])[:16]}-{sha(json.dumps(key, sort_keys=True))[:16]}{SUFFIX}"
        return cls(directory, key, os.path.join(directory, name))

    def restore(self, model: nn.Module) -> bool:
        """Fill the meta-device model (its modules already the load's) from the entry: True on a hit, after which
        the model is complete but for its RoPE tables and the tie of a float head (the loader's finish)."""
        if not os.path.exists(self.file):
            return False
        try:
            with safe_open(self.file, "pt") as f:
                layouts = json.loads(f.metadata()["layouts"])
            tensors = load_file(self.file)  # memory-mapped
        except Exception as e:  # safetensors raises its own error types for a truncated or corrupt file
            print(f"warning: weights cache {self.file}: unreadable ({type(e).__name__}: {e}); converting again",
                  file=sys.stderr)
            return False
        targets = {}
        for name in tensors:
            prefix, _, key = name.rpartition(".")
            module = model.get_submodule(prefix) if prefix else model
            if key not in module._parameters and key not in module._buffers:
                return False  # made by other code or another file: the structure differs
            targets[name] = module, key
        for name, (module, key) in targets.items():
            if key in module._parameters:
                setattr(module, key, nn.Parameter(tensors[name], requires_grad=False))
            else:
                module._buffers[key] = tensors[name]
        for name, kernel in layouts.items():
            model.get_submodule(name).kernel = kernel
        return True

    def store(self, model: nn.Module) -> None:
        """Write the loaded model as this entry, then prune the directory. A failure (a full disk, a directory that
        cannot be written) is a warning: the model is loaded either way."""
        tensors = {name: t.contiguous() for name, t in [*model.named_parameters(), *model.named_buffers()]
                   if not name.startswith("rope")}  # reset_rope's tables are made, not loaded
        layouts = {name: m.kernel for name, m in model.named_modules() if isinstance(m, Int4Linear)}
        temporary = f"{self.file}.{os.getpid()}.tmp"
        try:
            os.makedirs(self.directory, exist_ok=True)
            save_file(tensors, temporary, metadata={"key": json.dumps(self.key), "layouts": json.dumps(layouts)})
            os.replace(temporary, self.file)
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:  # safetensors' own for its I/O errors
            print(f"warning: could not write the weights cache {self.file} ({type(e).__name__}: {e})",
                  file=sys.stderr)
            if os.path.exists(temporary):
                os.remove(temporary)
            return
        self.prune()

    def prune(self) -> None:
        """Remove entries whose source file changed or is gone, and all but the newest KEEP of this source's."""
        own = []
        for name in os.listdir(self.directory):
            file = os.path.join(self.directory, name)
            if not name.endswith(SUFFIX):
                continue
            try:
                with safe_open(file, "pt") as f:
                    key = json.loads(f.metadata()["key"])
                stale = not os.path.exists(key["source"]) or source_state(key["source"]) != {
                    k: key[k] for k in ("source", "size", "mtime_ns")}
            except Exception:  # unreadable: not an entry this code can use
                stale = True
            if stale:
                os.remove(file)
            elif key["source"] == self.key["source"]:
                own.append((os.stat(file).st_mtime_ns, file))
        for _, file in sorted(own, reverse=True)[KEEP:]:
            os.remove(file)
