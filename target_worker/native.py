"""The native CPU forward: `csrc/forward.c` compiled for this machine and called with ctypes.

A float32 `~target_worker.model.Decoder` on the CPU runs its whole forward (every layer, the
final norm and the LM head) as one call into ``forward.c``, which reads each weight in the
format it is stored in: the GGUF file's own blocks (Q4_0, Q4_1, Q8_0, F16, BF16) when the
decoder was loaded from one (`StoredWeight`, `target_worker.gguf.read_gguf_stored`), else the
decoder's float32 tensors. The arithmetic is float32 throughout, on the values a dequantized
copy holds (gguf-py's rounding), so it is the same model as the torch forward, reading
4-6x fewer bytes per token from a 4-bit file.

Batch invariance is by construction (see the comment at the top of ``forward.c``): each row's
logits, hidden rows and KV entries come from one fixed instruction sequence whatever the other
rows, the call's size or the thread split. `check_native` proves it on this machine at start-up
all the same, against rows computed alone, with data that includes denormals.

The library is built once per machine and source (``cc -O3 -march=native -ffp-contract=off``)
into ``<cache_dir>/kernels/`` (`target_worker.disk_cache.cache_dir`); `SPECD_NATIVE=0` turns
the native forward off (the torch forward of `target_worker.model` then runs), and a machine
without a C compiler falls back to it with one line saying why (`native_unavailable`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from .stored import GGML_TYPES, StoredWeight

__all__ = [
    "GGML_TYPES",
    "KV_DTYPES",
    "MODES",
    "NativeForward",
    "NativeUnavailable",
    "StoredWeight",
    "check_native",
    "fingerprint",
    "library",
    "native_compiler",
    "native_enabled",
    "native_unavailable",
    "prove",
    "supports",
]

_F32, _F16, _BF16 = 0, 1, 30
#: Added to a type id for weights repacked for the int8 kernels (forward.c's T_PACKED).
_PACKED = 100

_SOURCE = Path(__file__).resolve().parent / "csrc" / "forward.c"
_FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-pthread", "-fno-math-errno")


def _march() -> str:
    """``-march=`` of the build: ``$SPECD_NATIVE_MARCH`` (e.g. ``x86-64-v3`` for the AVX2
    kernels, ``x86-64`` for the plain C ones, to test them on a newer CPU), else native."""
    return f"-march={os.environ.get('SPECD_NATIVE_MARCH') or 'native'}"
_ABI = 1

#: The native forward's arithmetic: ``float32`` multiplies float32 activations by the
#: weights' float32 values; ``q8`` rounds activations to 8-bit blocks for Q4_0 / Q4_1 / Q8_0
#: weights and multiplies in integers (llama.cpp's arithmetic for such files), float32 for
#: any other weight; ``bfloat16`` is float32 arithmetic on a bfloat16 decoder's weights.
#: Norms, RoPE, attention and the residual stream are float32 in every mode.
MODES = {"float32": 0, "q8": 1, "bfloat16": 0}
#: The KV cache's dtype per mode: ``q8`` keeps keys and values in float16, as llama.cpp
#: does by default (half the bytes attention reads); ``bfloat16`` (a bfloat16 decoder:
#: bfloat16 weights, float32 arithmetic) in bfloat16.
KV_DTYPES = {"float32": torch.float32, "q8": torch.float16, "bfloat16": torch.bfloat16}

#: Errors ``specd_forward`` returns (forward.c's E_*).
_ERRORS = {1: "bad arguments", 2: "out of memory", 3: "a position beyond the RoPE table"}


class NativeUnavailable(RuntimeError):
    """The native forward cannot run here (no C compiler, a failed build, off by setting)."""


# --- the library ---------------------------------------------------------------------------


class _WMat(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("pad", ctypes.c_int32), ("row_bytes", ctypes.c_int64),
                ("data", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _WMat * 3), ("n_qkv", ctypes.c_int32), ("n_gate_up", ctypes.c_int32),
                ("gate_up", _WMat * 2), ("o", _WMat), ("down", _WMat),
                ("qkv_bias", ctypes.c_void_p), ("attn_norm", ctypes.c_void_p),
                ("ffn_norm", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [("n_layers", ctypes.c_int32), ("hidden", ctypes.c_int32),
                ("n_heads", ctypes.c_int32), ("n_kv_heads", ctypes.c_int32),
                ("head_dim", ctypes.c_int32), ("ffn", ctypes.c_int32),
                ("vocab", ctypes.c_int32), ("key_block", ctypes.c_int32),
                ("eps", ctypes.c_float), ("kv_type", ctypes.c_int32),
                ("mode", ctypes.c_int32), ("pad", ctypes.c_int32), ("embed", _WMat),
                ("head", _WMat), ("norm", ctypes.c_void_p), ("layers", ctypes.c_void_p)]


class _Batch(ctypes.Structure):
    _fields_ = [("n_rows", ctypes.c_int32), ("n_segs", ctypes.c_int32),
                ("tokens", ctypes.c_void_p), ("seg_lo", ctypes.c_void_p),
                ("seg_hi", ctypes.c_void_p), ("seg_start", ctypes.c_void_p),
                ("seg_blocks", ctypes.c_void_p), ("seg_k", ctypes.c_void_p),
                ("seg_v", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("rope_len", ctypes.c_int32), ("n_capture", ctypes.c_int32),
                ("capture", ctypes.c_void_p), ("hidden", ctypes.c_void_p),
                ("n_logit_rows", ctypes.c_int32), ("logit_rows", ctypes.c_void_p),
                ("logits", ctypes.c_void_p), ("threads", ctypes.c_int32)]


_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_UNAVAILABLE: str | None = None


def native_enabled() -> bool:
    """Whether the native forward may be used (``SPECD_NATIVE`` is not ``0``)."""
    return os.environ.get("SPECD_NATIVE", "1") != "0"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in ("flags", "Features"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def native_compiler() -> str | None:
    """The C compiler the native forward is built with (``$CC``, else cc, gcc or clang on
    PATH), or None."""
    cc = os.environ.get("CC")
    if cc:  # asked for by name: that one or none
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _library_path(cc: str) -> Path:
    from .disk_cache import cache_dir

    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    key = hashlib.sha256(b"\0".join([
        _SOURCE.read_bytes(), " ".join((*_FLAGS, _march())).encode(), version.encode(),
        platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:16]
    return cache_dir() / "kernels" / f"forward-{key}.so"


def _build(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    print(f"[specd] compiling the native forward for this CPU into {target.parent} "
          "(once per machine, a few seconds)...", file=sys.stderr, flush=True)
    cmd = [cc, *_FLAGS, _march(), "-o", str(tmp), str(_SOURCE), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"{cc} could not run: {exc}") from None
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NativeUnavailable(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
    os.replace(tmp, target)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.specd_abi.restype = ctypes.c_int
    lib.specd_isa.restype = ctypes.c_char_p
    lib.specd_vector_lanes.restype = ctypes.c_int
    lib.specd_model_new.restype = ctypes.c_void_p
    lib.specd_model_new.argtypes = [ctypes.POINTER(_Model)]
    lib.specd_model_free.argtypes = [ctypes.c_void_p]
    lib.specd_forward.restype = ctypes.c_int
    lib.specd_forward.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Batch)]
    lib.specd_matmul.restype = ctypes.c_int
    lib.specd_matmul.argtypes = [ctypes.POINTER(_WMat), ctypes.c_void_p, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.specd_dequant_row.argtypes = [ctypes.POINTER(_WMat), ctypes.c_int, ctypes.c_void_p]
    lib.specd_exp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.specd_set_spin_ns.argtypes = [ctypes.c_long]
    lib.specd_packed_bytes.restype = ctypes.c_size_t
    lib.specd_packed_bytes.argtypes = [ctypes.POINTER(_WMat)]
    lib.specd_repack.restype = ctypes.c_int
    lib.specd_repack.argtypes = [ctypes.POINTER(_WMat), ctypes.c_void_p]
    lib.specd_tune.restype = ctypes.c_int
    lib.specd_tune.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.specd_profile.restype = ctypes.c_int
    lib.specd_profile.argtypes = [ctypes.c_int, ctypes.c_void_p]
    if lib.specd_abi() != _ABI:
        raise NativeUnavailable(f"the built library speaks ABI {lib.specd_abi()}, not {_ABI}")
    return lib


def library() -> ctypes.CDLL:
    """The native library, built first if this machine has none for the current source.

    Raises:
        NativeUnavailable: turned off (``SPECD_NATIVE=0``), no C compiler, or the build
            failed (the message says which, with the compiler's output).
    """
    global _LIB, _UNAVAILABLE
    with _LOCK:
        if _LIB is not None:
            return _LIB
        if not native_enabled():
            raise NativeUnavailable("SPECD_NATIVE=0")
        if _UNAVAILABLE is not None:
            raise NativeUnavailable(_UNAVAILABLE)
        try:
            cc = native_compiler()
            if cc is None:
                raise NativeUnavailable("no C compiler (cc, gcc or clang) on PATH")
            target = _library_path(cc)
            if not target.is_file():
                import fcntl

                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target.with_name(target.name + ".lock"), "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent actors build once
                    if not target.is_file():
                        _build(cc, target)
            try:
                _LIB = _bind(ctypes.CDLL(str(target)))
            except OSError as exc:
                raise NativeUnavailable(f"{target} did not load: {exc}") from None
        except NativeUnavailable as exc:
            _UNAVAILABLE = str(exc)
            raise
        return _LIB


def native_unavailable() -> str | None:
    """Why the native forward cannot run here, or None when it can (builds it if needed)."""
    try:
        library()
    except NativeUnavailable as exc:
        return str(exc)
    return None


def isa() -> str:
    """The vector instructions the library was built with: ``avx512``, ``avx2`` or
    ``generic``, and its float lanes per vector."""
    lib = library()
    return f"{lib.specd_isa().decode()} ({lib.specd_vector_lanes()} lanes)"


# --- weights -------------------------------------------------------------------------------


_TENSOR_TYPES = {torch.float32: _F32, torch.bfloat16: _BF16, torch.float16: _F16}


def _wmat(w: torch.Tensor | StoredWeight) -> _WMat:
    if isinstance(w, StoredWeight):
        return _WMat(w.type, w.n, w.k, 0, w.data.shape[1], w.data.data_ptr())
    if w.dtype not in _TENSOR_TYPES or w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"a native weight must be contiguous float32, bfloat16 or float16 "
                         f"[n, k], got {w.dtype} {tuple(w.shape)}")
    return _WMat(_TENSOR_TYPES[w.dtype], w.shape[0], w.shape[1], 0,
                 w.shape[1] * w.element_size(), w.data_ptr())


def _slots(decoder) -> list[tuple[dict, str]]:
    """Where each tensor the forward reads is held: ``(module._parameters, name)``."""
    out = [(decoder.embed_tokens._parameters, "weight"), (decoder.lm_head._parameters, "weight"),
           (decoder.norm._parameters, "weight")]
    for layer in decoder.layers:
        out += [(layer.attn.wqkv._parameters, "weight"), (layer.attn.wo._parameters, "weight"),
                (layer.ffn.w_gate_up._parameters, "weight"),
                (layer.ffn.w_down._parameters, "weight"),
                (layer.attn_norm._parameters, "weight"), (layer.ffn_norm._parameters, "weight")]
        if layer.attn.wqkv._parameters.get("bias") is not None:
            out.append((layer.attn.wqkv._parameters, "bias"))
    return out


def fingerprint(decoder) -> tuple:
    """Which tensors ``decoder``'s weights are and how often each was changed in place: two
    equal fingerprints mean the same float32 weights (a loader records it beside
    ``stored_weights``; `NativeForward` describes the model again when it changes)."""
    return tuple((id(t), t.data_ptr(), t._version) for t in
                 (params[name] for params, name in _slots(decoder)))


def supports(decoder) -> str | None:
    """Why ``decoder`` cannot run natively, or None when it can: a plain float32 or bfloat16
    dense Llama-family `~target_worker.model.Decoder` on the CPU (not a tensor-parallel shard,
    no MoE, head_dim even and at most 512)."""
    c = decoder.config
    if not type(decoder).__dict__.get("NATIVE_FORWARD", False):
        return f"{type(decoder).__name__} runs the torch forward"
    if c.moe is not None:
        return "mixture-of-experts layers run the torch forward"
    if decoder.dtype not in (torch.float32, torch.bfloat16):
        return f"{str(decoder.dtype).split('.')[-1]} runs the torch forward"
    if decoder.norm.weight.device.type != "cpu":
        return "not on the CPU"
    if c.head_dim % 2 or c.head_dim > 512:
        return f"head_dim {c.head_dim} (the native forward takes even sizes up to 512)"
    return None


class NativeForward:
    """The native forward of one float32 or bfloat16 `~target_worker.model.Decoder`, in
    ``mode`` (`MODES`).

    It multiplies the decoder's `StoredWeight` s (``decoder.stored_weights``) where the
    decoder has them and they still describe its float32 weights, else the decoder's own
    tensors; it holds references to every tensor it points at. `forward` notices a weight
    replaced or changed in place and describes the model again.

    Not picklable or copyable by design: a copy of the decoder gets None and builds its own.
    """

    def __init__(self, decoder, mode: str = "float32") -> None:
        why = supports(decoder)
        if why is not None:
            raise NativeUnavailable(why)
        if mode not in MODES:
            raise ValueError(f"native mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._lib = library()
        self._decoder_config = decoder.config
        self._handle = None
        self._describe(decoder)
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)

    def __reduce__(self):
        return (type(None), ())

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.specd_model_free(handle)

    def _describe(self, decoder) -> None:
        """Builds the C model description from ``decoder`` (and its stored weights while
        they match the float32 tensors they were loaded with)."""
        c = decoder.config
        stored = getattr(decoder, "stored_weights", None) or {}
        if stored and getattr(decoder, "stored_fingerprint", None) != fingerprint(decoder):
            stored = {}  # the float32 weights changed since they were loaded: use those
        keep: list[torch.Tensor] = []

        def weight(name: str, tensor: torch.Tensor) -> _WMat:
            w = stored.get(name)
            if w is not None and (w.n, w.k) == tuple(tensor.shape):
                keep.append(w.data)
                return _wmat(w)
            keep.append(tensor)
            return _wmat(tensor)

        def f32(t: torch.Tensor | None) -> int | None:
            """A norm or bias as float32 (exact from bfloat16 / float16), kept alive."""
            if t is None:
                return None
            t = t.detach().float().contiguous()
            keep.append(t)
            return t.data_ptr()

        def rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
            return t[lo:hi]  # contiguous: a range of whole rows

        h, kvh, d, f = c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim
        layers = (_Layer * c.n_layers)()
        for i, block in enumerate(decoder.layers):
            lay = layers[i]
            wqkv = block.attn.wqkv.weight
            parts = [("q", 0, h * d), ("k", h * d, (h + kvh) * d),
                     ("v", (h + kvh) * d, (h + 2 * kvh) * d)]
            if all(f"{i}.{p}" in stored for p, _, _ in parts):
                for j, (p, lo, hi) in enumerate(parts):
                    lay.qkv[j] = weight(f"{i}.{p}", rows(wqkv, lo, hi))
                lay.n_qkv = 3
            else:
                lay.qkv[0] = weight(f"{i}.qkv", wqkv)
                lay.n_qkv = 1
            gu = block.ffn.w_gate_up.weight
            if f"{i}.gate" in stored and f"{i}.up" in stored:
                lay.gate_up[0] = weight(f"{i}.gate", rows(gu, 0, f))
                lay.gate_up[1] = weight(f"{i}.up", rows(gu, f, 2 * f))
                lay.n_gate_up = 2
            else:
                lay.gate_up[0] = weight(f"{i}.gate_up", gu)
                lay.n_gate_up = 1
            lay.o = weight(f"{i}.o", block.attn.wo.weight)
            lay.down = weight(f"{i}.down", block.ffn.w_down.weight)
            lay.qkv_bias = f32(block.attn.wqkv.bias)
            lay.attn_norm = f32(block.attn_norm.weight)
            lay.ffn_norm = f32(block.ffn_norm.weight)
        embed = weight("embed", decoder.embed_tokens.weight)
        head = weight("embed" if c.tie_embeddings else "head", decoder.head_weight())
        from .kv_cache import KEY_BLOCK

        mode = MODES[self.mode]
        kv = {torch.float32: _F32, torch.float16: _F16,
              torch.bfloat16: _BF16}[KV_DTYPES[self.mode]]
        model = _Model(c.n_layers, c.hidden_size, h, kvh, d, f, c.vocab_size, KEY_BLOCK,
                       c.rms_norm_eps, kv, mode, 0, embed, head, f32(decoder.norm.weight),
                       ctypes.cast(layers, ctypes.c_void_p))
        handle = self._lib.specd_model_new(ctypes.byref(model))
        if not handle:
            raise MemoryError("the native forward could not allocate its model")
        old, self._handle = self._handle, handle
        if old:
            self._lib.specd_model_free(old)
        self._keep = keep
        self._layers = layers
        self._head = head
        self._watch = [(params, name, params[name], params[name]._version)
                       for params, name in _slots(decoder)]
        self.weight_types = sorted({GGML_TYPES[w.type][0] for w in self._mats()})

    def _mats(self) -> list[_WMat]:
        """Every matrix the forward multiplies (the LM head's too)."""
        out = [self._head]
        for lay in self._layers:
            out += [lay.qkv[j] for j in range(lay.n_qkv)]
            out += [lay.gate_up[j] for j in range(lay.n_gate_up)]
            out += [lay.o, lay.down]
        return out

    def _rope(self, decoder, end: int) -> None:
        """Float32 RoPE tables covering positions ``[0, end)``, grown geometrically as the
        decoder's own (`rope_tables` over whole 256-position rows on one thread, so a
        position's values never depend on the table's size); float32 whatever the
        decoder's dtype."""
        if end <= self._cos.shape[0]:
            return
        from .attention import rope_tables
        from .invariant import one_thread

        c = decoder.config
        size = min(max(end, 2 * self._cos.shape[0], 256), c.max_seq_len)
        with one_thread():
            cos, sin = rope_tables(c.head_dim, c.rope_theta, -(-size // 256) * 256,
                                   c.rope_scaling)
        self._cos, self._sin = cos.contiguous(), sin.contiguous()

    def forward(self, decoder, ids: Sequence[torch.Tensor], segments, last_logits_only,
                capture: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`Decoder.forward_packed` natively, after the decoder checked the segments and
        reserved their caches: ``ids`` the token ids per segment, ``segments`` the
        ``(tokens, start_pos, cache)`` triples, ``capture`` the layers whose residual
        streams are the hidden rows (``()``: the final-norm rows). Returns, per segment,
        ``(logits [n_i or 1, vocab], hidden [n_i, width])`` float32 views of shared
        buffers; every cache's ``seq_len`` is left to the caller."""
        for params, name, tensor, version in self._watch:
            if params.get(name) is not tensor or tensor._version != version:
                self._describe(decoder)  # a weight was replaced or changed in place
                break
        c = decoder.config
        kv_dtype = KV_DTYPES[self.mode]
        n_segs = len(segments)
        lo = torch.empty(n_segs, dtype=torch.int32)
        hi = torch.empty(n_segs, dtype=torch.int32)
        start = torch.empty(n_segs, dtype=torch.int32)
        blocks = torch.empty(n_segs, dtype=torch.int32)
        kp = (ctypes.c_void_p * n_segs)()
        vp = (ctypes.c_void_p * n_segs)()
        logit_rows: list[int] = []
        counts: list[int] = []
        row, end = 0, 0
        for s, (idx, (_, pos, cache), last) in enumerate(
                zip(ids, segments, last_logits_only, strict=True)):
            n = idx.numel()
            if cache.k.dtype != kv_dtype or not cache.k.is_contiguous() \
                    or not cache.v.is_contiguous():
                raise ValueError(f"segment {s}: a {str(cache.k.dtype).split('.')[-1]} KV cache, "
                                 f"but this decoder's ({self.mode}) are "
                                 f"{str(kv_dtype).split('.')[-1]}: make caches with "
                                 "decoder.new_cache() after make_batch_invariant")
            lo[s], hi[s], start[s], blocks[s] = row, row + n, pos, cache.k.shape[1]
            kp[s], vp[s] = cache.k.data_ptr(), cache.v.data_ptr()
            if last:
                logit_rows.append(row + n - 1)
                counts.append(1)
            else:
                logit_rows.extend(range(row, row + n))
                counts.append(n)
            row += n
            end = max(end, pos + n)
        self._rope(decoder, end)
        tokens = (ids[0] if n_segs == 1 else torch.cat(ids)).to(torch.int32).contiguous()
        cap = torch.tensor(list(capture), dtype=torch.int32)
        width = max(1, len(capture)) * c.hidden_size
        hidden = torch.empty(row, width, dtype=torch.float32)
        rows_t = torch.tensor(logit_rows, dtype=torch.int32)
        logits = torch.empty(len(logit_rows), c.vocab_size, dtype=torch.float32)
        batch = _Batch(row, n_segs, tokens.data_ptr(), lo.data_ptr(), hi.data_ptr(),
                       start.data_ptr(), blocks.data_ptr(), ctypes.cast(kp, ctypes.c_void_p),
                       ctypes.cast(vp, ctypes.c_void_p), self._cos.data_ptr(),
                       self._sin.data_ptr(), self._cos.shape[0], len(capture), cap.data_ptr(),
                       hidden.data_ptr(), len(logit_rows), rows_t.data_ptr(),
                       logits.data_ptr(), torch.get_num_threads())
        rc = self._lib.specd_forward(self._handle, ctypes.byref(batch))
        if rc:
            raise RuntimeError(f"native forward failed: {_ERRORS.get(rc, rc)}")
        out, at = [], 0
        for s, k in enumerate(counts):
            out.append((logits[at:at + k], hidden[int(lo[s]):int(hi[s])]))
            at += k
        return out


# --- the start-up check --------------------------------------------------------------------

_PROVEN: set[str] = set()


def _verdicts_path() -> Path:
    from .disk_cache import cache_dir

    return cache_dir() / "native_invariance.json"


def prove(decoder, threads: Sequence[int]) -> dict:
    """Makes ``decoder`` run its native forward, after `check_native` proved it batch
    invariant at ``threads`` (and one thread) on this machine: once per library build,
    model shape and weight types, the verdict kept in ``native_invariance.json`` under the
    cache root (a start that finds it there checks nothing).

    Returns:
        ``{"isa": ..., "weights": [type names], "threads": [...], "checked": "now" |
        "before"}``.

    Raises:
        NativeUnavailable: the library cannot be built or loaded, the decoder is not one
            it runs, or the check failed (its message says which row differed).
    """
    import json
    from dataclasses import asdict

    counts = tuple(dict.fromkeys((1, *threads)))
    forward = decoder._native_forward()
    lib_name = Path(library()._name).name
    key = hashlib.sha256(json.dumps([lib_name, asdict(decoder.config), forward.weight_types,
                                     forward.mode, counts], sort_keys=True).encode()
                         ).hexdigest()[:24]
    report = {"isa": isa(), "mode": forward.mode, "weights": forward.weight_types,
              "threads": list(counts), "checked": "before"}
    path = _verdicts_path()
    if key in _PROVEN:
        return report
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    if not (isinstance(stored, dict) and stored.get(key) is True):
        try:
            check_native(decoder, counts)
        except RuntimeError as exc:
            raise NativeUnavailable(f"the batch-invariance check failed: {exc}") from None
        report["checked"] = "now"
        if os.environ.get("SPECD_INVARIANCE_CACHE", "1") != "0":
            try:
                stored = stored if isinstance(stored, dict) else {}
                stored[key] = True
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(stored, indent=0, sort_keys=True))
                os.replace(tmp, path)
            except OSError:
                pass  # an unwritable cache only costs the check again next start
    _PROVEN.add(key)
    return report



def check_native(decoder, threads: Sequence[int] = (1, 2)) -> None:
    """Proves on this machine that ``decoder``'s native forward is batch invariant: a
    verify-sized block, a batch of three segments and a prompt chunk give every row's
    logits and hidden rows bitwise the rows computed alone, one token at a time, at each
    thread count of ``threads``; and every matmul kernel shape (1 to 17 rows, every weight
    type in use) gives each row the bits of that row alone on data with denormals.

    Raises:
        RuntimeError: naming what differed (the native forward must then not be used).
    """
    if not type(decoder).__dict__.get("NATIVE_FORWARD", False):
        raise NativeUnavailable(f"{type(decoder).__name__} runs the torch forward")
    lib = library()
    gen = torch.Generator().manual_seed(0)
    # The kernels the forward runs (q8: the int8 ones on repacked weights), one matrix per
    # type and shape, on data with denormals, products near the denormal range and exact
    # cancellations, at every row count a verify block or a small batch produces.
    native = decoder._native_forward()
    shapes: dict[tuple[int, int, int], _WMat] = {}
    for mat in native._mats():
        shapes.setdefault((mat.type, mat.n, mat.k), mat)
    for mat in shapes.values():
        name = f"{GGML_TYPES[mat.type][0]} {mat.n}x{mat.k}"
        keep = None
        if native.mode == "q8" and lib.specd_packed_bytes(ctypes.byref(mat)):
            keep = torch.empty(lib.specd_packed_bytes(ctypes.byref(mat)), dtype=torch.uint8)
            lib.specd_repack(ctypes.byref(mat), keep.data_ptr())
            mat = _WMat(mat.type + _PACKED, mat.n, mat.k, 0, 0, keep.data_ptr())
            name += " (int8)"
        _check_kernel(lib, mat, name, threads, gen)
        del keep
    _check_forward(decoder, threads, gen)


def _check_kernel(lib, mat: _WMat, name: str, threads: Sequence[int],
                  gen: torch.Generator) -> None:
    """Every row of calls of 2-17 rows, at each thread count, against the row alone."""
    k = mat.k
    kp = -(-k // 32) * 32  # rows padded with zeros to whole vectors, as the forward's
    x = torch.randn(17, kp, generator=gen)
    x[:, k:] = 0
    x[::3, : k // 2] *= 1e-39  # denormal activations
    x[1::4, ::5] = 0.0
    x[2, 1:k:2] = -x[2, 0:k - 1:2]  # pairs that cancel
    alone = torch.empty(17, mat.n)
    for r in range(17):
        for t in threads:
            y = torch.empty(1, mat.n)
            lib.specd_matmul(ctypes.byref(mat), x[r:r + 1].data_ptr(), 1, kp, y.data_ptr(), t)
            if t == threads[0]:
                alone[r] = y[0]
            elif not torch.equal(y[0], alone[r]):
                raise RuntimeError(f"native matmul {name}: a row differs between "
                                   f"{threads[0]} and {t} threads")
    for rows in (2, 3, 4, 5, 8, 9, 16, 17):
        for t in threads:
            y = torch.empty(rows, mat.n)
            lib.specd_matmul(ctypes.byref(mat), x[:rows].data_ptr(), rows, kp, y.data_ptr(), t)
            if not torch.equal(y, alone[:rows]):
                raise RuntimeError(f"native matmul {name}: rows differ from rows alone in a "
                                   f"call of {rows} rows on {t} threads")


def _check_forward(decoder, threads: Sequence[int], gen: torch.Generator) -> None:
    """The whole forward: rows fed alone against the same rows inside blocks, batches and
    chunks, at each thread count."""
    c = decoder.config
    vocab = c.vocab_size
    prompt = torch.randint(0, vocab, (40,), generator=gen).tolist()
    extra = torch.randint(0, vocab, (12,), generator=gen).tolist()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads[0])
        alone = decoder.new_cache()
        ref = [decoder.forward_batch_with_hidden([t], p, alone) for p, t in
               enumerate(prompt + extra)]
        for t in threads:
            torch.set_num_threads(t)
            # A prompt chunk of 31, a chunk of 9, a verify block of 12 beside two other
            # sequences.
            cache = decoder.new_cache()
            got = decoder.forward_batch_with_hidden(prompt[:31], 0, cache)
            _same(got, ref[:31], f"a 31-token chunk on {t} threads")
            got = decoder.forward_batch_with_hidden(prompt[31:], 31, cache)
            _same(got, ref[31:40], f"a 9-token chunk on {t} threads")
            others = [decoder.new_cache(), decoder.new_cache()]
            # The decoder's own method: a caller's patch of forward_packed sees no check.
            out = decoder._forward_packed([(extra, 40, cache), (prompt[:5], 0, others[0]),
                                           (extra[:3], 0, others[1])], [False] * 3)
            _same(out[0], ref[40:], f"a 12-token block beside two sequences on {t} threads")
    finally:
        torch.set_num_threads(before)


def _same(got, ref, what: str) -> None:
    logits, hidden = got
    for i, (rl, rh) in enumerate(ref):
        if not (torch.equal(logits[i], rl[0]) and torch.equal(hidden[i], rh[0])):
            raise RuntimeError(f"native forward: row {i} of {what} differs from the row "
                               "computed alone")
