"""Streaming a checkpoint from an object store straight into the model (no file on disk).

The download-then-load path (:func:`labkit.model.objstore.fetch_checkpoint`) writes every byte to
the node's disk and reads it back. A streaming loader (vLLM's ``--load-format runai_streamer``)
reads each safetensors header first, builds the empty model, then fetches every tensor's byte
range on parallel connections and copies it into its parameter as soon as its last byte lands:
download and placement overlap, and nothing touches the disk. On a GPU the copy is the host to
device transfer; here it is a copy (and a dtype cast when the checkpoint's dtype differs).
"""

from __future__ import annotations

import bisect
import json
import struct
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from labkit.errors import CheckpointError
from labkit.model.loader import _checkpoint_views, load_config
from labkit.model.meta import empty_model, materialize
from labkit.model.objstore import S3Source, _parts, download_objects, get_range, list_checkpoint

ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F64": torch.float64}


def read_header(src: S3Source, client: Any, name: str, size: int, etag: str
                ) -> tuple[int, dict]:
    """(offset of the data section, header) of one safetensors object, from two small GETs."""
    if size < 8:
        raise CheckpointError(f"{src.uri}/{name}: {size} bytes, shorter than a safetensors "
                              "header")
    (n,) = struct.unpack("<Q", get_range(src, client, name, etag, 0, 8))
    if 8 + n > size:
        raise CheckpointError(f"{src.uri}/{name}: header of {n} bytes in a {size}-byte object "
                              "(truncated)")
    try:
        header = json.loads(get_range(src, client, name, etag, 8, 8 + n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{src.uri}/{name}: corrupt safetensors header ({e})") from e
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end != size:
        raise CheckpointError(f"{src.uri}/{name}: its header describes {8 + n + end} bytes "
                              f"but the object has {size} (truncated or mismatched upload)")
    return 8 + n, header


class _Tensor:
    """One tensor being assembled from the reads that cover it; copied into its parameter when
    its last byte has landed."""

    def __init__(self, name: str, info: dict, target: torch.Tensor) -> None:
        if info["dtype"] not in ST_DTYPES:
            raise CheckpointError(f"tensor {name!r}: unsupported dtype {info['dtype']}")
        if tuple(info["shape"]) != tuple(target.shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(info['shape'])} but "
                                  f"config.json implies {tuple(target.shape)}")
        self.info, self.target = info, target
        self.start, self.end = info["data_offsets"]
        self.buf = bytearray(self.end - self.start)
        self.left, self.lock = self.end - self.start, threading.Lock()
        if self.left == 0:
            self._place()

    def put(self, read_start: int, data: bytes) -> None:
        """Take this tensor's share of a read that began at ``read_start`` (data offsets)."""
        lo, hi = max(self.start, read_start), min(self.end, read_start + len(data))
        if lo >= hi:
            return
        self.buf[lo - self.start:hi - self.start] = data[lo - read_start:hi - read_start]
        with self.lock:
            self.left -= hi - lo
            done = self.left == 0
        if done:
            self._place()

    def _place(self) -> None:
        dt = ST_DTYPES[self.info["dtype"]]
        t = torch.frombuffer(self.buf, dtype=dt) if self.buf else torch.empty(0, dtype=dt)
        with torch.no_grad():
            self.target.copy_(t.reshape(self.info["shape"]))
        self.buf = bytearray()


def _file_jobs(src: S3Source, client: Any, name: str, size: int, etag: str,
               params: dict[str, torch.Tensor], tied: bool, seen: set[str]) -> list[tuple]:
    """Reads of ``part_size`` over one file's data section, ignoring tensor boundaries (a model
    has hundreds of small tensors: one GET each would pay the request overhead hundreds of
    times, so streamers coalesce); each read hands its bytes to the tensors it overlaps."""
    base, header = read_header(src, client, name, size, etag)
    tensors = []
    for tname, info in header.items():
        if tname.endswith("rotary_emb.inv_freq") or (tname == "lm_head.weight" and tied
                                                     and tname not in params):
            continue
        if tname not in params:
            raise CheckpointError(f"{name}: unexpected tensor {tname!r} (does config.json "
                                  "match this checkpoint?)")
        tensors.append(_Tensor(tname, info, params[tname]))
        seen.add(tname)
    tensors.sort(key=lambda t: t.start)
    starts = [t.start for t in tensors]
    return [(name, etag, base, s, e, tensors, starts) for s, e in _parts(size - base,
                                                                         src.part_size)]


def _run_job(src: S3Source, client: Any, job: tuple) -> None:
    name, etag, base, s, e, tensors, starts = job
    data = get_range(src, client, name, etag, base + s, base + e)
    for t in tensors[max(bisect.bisect_right(starts, s) - 1, 0):]:
        if t.start >= e:
            break
        t.put(s, data)


def _small_files(src: S3Source, client: Any, listing: dict, pool: ThreadPoolExecutor,
                 folder: Path) -> None:
    small = {n: v for n, v in listing.items() if not n.endswith(".safetensors")}
    for name, data in download_objects(src, client, small, "ranged", pool).items():
        (folder / name).write_bytes(data)


def load_streaming(src: S3Source | str, dtype: torch.dtype = torch.float32,
                   skip_tokenizer_init: bool = False) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer or None) streamed from ``src``; config and tokenizer files go to a
    temporary folder, the weights only into the model's memory."""
    from labkit.model.llama import causal_lm_class
    from labkit.model.tokenizer import Tokenizer

    src = src if isinstance(src, S3Source) else S3Source(src)
    client = src.client()
    listing = list_checkpoint(src, client)
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(src.max_connections) as pool:
        folder = Path(tmp)
        _small_files(src, client, listing, pool, folder)
        config = load_config(folder)
        with empty_model():
            model = causal_lm_class(config)(config)
        model = materialize(model, "cpu").to(dtype)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        params = dict(model.named_parameters())
        views, parts = _checkpoint_views(model)
        seen: set[str] = set()
        jobs = []  # every shard's reads at once, on the pool's connections
        for name in _shards(folder, listing):
            size, etag = listing[name]
            jobs += _file_jobs(src, client, name, size, etag, {**params, **views},
                               config.tie_word_embeddings, seen)
        for _ in pool.map(lambda job: _run_job(src, client, job), jobs):
            pass
        seen |= {p for p, disk in parts.items() if all(d in seen for d in disk)}
        missing = [n for n in params if n not in seen
                   and not (n == "lm_head.weight" and config.tie_word_embeddings)]
        if missing:
            raise CheckpointError(f"{src.uri}: checkpoint is missing {len(missing)} tensor(s), "
                                  f"e.g. {missing[:3]}")
        tok = None
        if not skip_tokenizer_init:
            eos = config.eos_token_ids
            tok = Tokenizer.from_dir(folder, config.bos_token_id, eos[0] if eos else None)
    return model.eval(), tok


def _shards(folder: Path, listing: dict) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [n for n in names if n not in listing]
        if missing:
            raise CheckpointError(f"shards named in the index are missing: {missing}")
        return names
    return ["model.safetensors"]
