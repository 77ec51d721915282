"""ONNX Runtime backend: CPU, or CUDA where onnxruntime-gpu is installed. Imports no Torch.

The cache stays in OrtValues: each step binds the previous step's `present`
outputs as this step's `past` inputs through IO binding, so no cache tensor
is copied through numpy between steps.
"""

from __future__ import annotations

import numpy as np

from kvforge.errors import KvforgeError, MissingDependencyError
from kvforge.ort_session import import_onnxruntime as _ort
from kvforge.ort_session import check_accuracy_level, make_session

from .backend import Backend, KVCache
from .ort import packed_cache as packed
from .ort.attention import CHUNK_SEQLENS, CHUNK_TOTAL, LOGITS_ROWS, SEQLENS, TOTAL, chunk_name
from .ort.variant import KEEP_INPUT, variant_path, weights_alike

_ONNX_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "bfloat16": "tensor(bfloat16)", "int64": "tensor(int64)"}


_OPTIMIZATION_LEVELS = ("all", "extended", "basic", "none")


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    option_names = ("device", "threads", "optimization", "variant", "attention", "spinning", "accuracy_level",
                    "prefill_accuracy_level")

    def __init__(self, config, io, bundle, device: str = "auto", threads: int | None = None, optimization: str = "all",
                 variant: bool = True, attention: str = "auto", spinning: bool = True, accuracy_level: int = 0,
                 prefill_accuracy_level: int | None = None, **options):
        super().__init__(config, io, **options)
        if device not in ("auto", "cpu", "cuda"):
            raise KvforgeError(f"onnxruntime device {device!r} is not one of 'auto', 'cpu', 'cuda'")
        if optimization not in _OPTIMIZATION_LEVELS:
            raise KvforgeError(f"optimization {optimization!r} is not one of {_OPTIMIZATION_LEVELS}")
        if attention not in ("auto", "graph"):
            raise KvforgeError(f"attention {attention!r} is not one of 'auto' (GroupQueryAttention over a packed cache "
                               "where the graph allows, on the CPU) or 'graph' (the bundle's attention)")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise KvforgeError(f"threads must be a positive int (or None for ONNX Runtime's default), got {threads!r}")
        self.bundle = bundle
        self.graph_path = bundle.graph_file
        self.variant = variant  # run the ORT-specific variant of the graph (see ort/variant.py)
        self.attention = attention
        self.packed = False  # the variant runs GroupQueryAttention over packed caches (ort/packed_cache.py)
        self._mixed = None  # the mixed step's session (prepare_mixed); False where there is none
        self.max_context = io.max_context or config["max_seq_len"]
        self.device = device
        self.threads = threads
        if not isinstance(spinning, bool):
            raise KvforgeError(f"spinning must be True or False, got {spinning!r}")
        self.spinning = spinning  # False: the threads stop spinning after each run (a draft beside its target)
        # MatMulNBits' accuracy level (kvforge/ort_session.ACCURACY_LEVELS): 0 exact; 4 (opt-in) 8-bit activations as
        # llama.cpp's dot products, faster and not exact; an INT4 bundle's fused kernels and the variant's own
        self.accuracy_level = check_accuracy_level(accuracy_level)
        # the level of the steps that carry more than one token a row (a prompt, a chunk, a draft's check), where it
        # differs: a second session over that level's graph, holding the weights again (None: accuracy_level's).
        # MatMulNBits at level 4 runs one row fast and many slower than level 0's kernels (docs/ort-variant.md)
        self.prefill_accuracy_level = None if prefill_accuracy_level is None else \
            check_accuracy_level(prefill_accuracy_level, "prefill_accuracy_level")
        self._prefill = None  # that session (activate_impl); None where every step runs on `session`
        self.shared_weights = {}  # the tables both sessions hold alike, held once (OrtValues by name)
        self.optimization = optimization
        self.session = None
        self.kv_dtype = io.input(io.past[0][0]).dtype if io.past else "float32"
        self.past_names = [n for layer in io.past for n in layer]
        self.present_names = [n for layer in io.present for n in layer]
        self.output_names = [t.name for t in io.outputs]
        self.quant_format = bundle.session_format

    @property
    def settings(self) -> dict:
        """The options this backend runs with, as load() takes them: what a benchmark records beside its figures."""
        return {name: getattr(self, name) for name in self.option_names}

    def __repr__(self) -> str:
        return f"OnnxRuntimeBackend({', '.join(f'{k}={v!r}' for k, v in self.settings.items())})"

    def _providers(self) -> list[str]:
        ort = _ort()
        available = ort.get_available_providers()
        if self.device == "cuda":
            if "CUDAExecutionProvider" not in available:
                raise MissingDependencyError(
                    "ONNX Runtime's CUDA provider", "Install onnxruntime-gpu (`bash scripts/install.sh --gpu`) on a machine with an NVIDIA GPU."
                )
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        if self.device == "auto" and "CUDAExecutionProvider" in available:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    def activate_impl(self) -> None:
        providers = self._providers()
        if self.kv_dtype == "bfloat16" and providers == ["CPUExecutionProvider"]:
            raise KvforgeError(
                "ONNX Runtime's CPU provider has no bfloat16 kernels; run this bundle on a GPU, "
                "with the torch backend, or export float16/float32 for the CPU"
            )
        self.graph_path = self._graph_for(providers, self.accuracy_level)
        self.shared_weights, path = {}, None
        if self.prefill_level != self.accuracy_level:
            # (without the variant both levels run the bundle's graph, already checked: only the session differs)
            path = self._graph_for(providers, self.prefill_level) if self.variant else self.graph_path
            # the tables both graphs hold alike, held once (on the CPU: a GPU session copies its weights anyway)
            if self.variant and providers == ["CPUExecutionProvider"]:
                ort = _ort()
                self.shared_weights = {n: ort.OrtValue.ortvalue_from_numpy(a)
                                       for n, a in weights_alike([self.graph_path, path]).items()}
        self.session = self._open(self.graph_path, providers, self.accuracy_level)
        if path is not None:
            # its threads stop spinning when a prompt is done, not to take the cores from the decode steps after it
            self._prefill = self._open(path, providers, self.prefill_level, spinning=False)
            if [i.name for i in self._prefill.get_inputs()] != [i.name for i in self.session.get_inputs()]:
                raise KvforgeError(f"{path} (prefill_accuracy_level={self.prefill_level}) takes other inputs than "
                                   f"{self.graph_path}: both levels' graphs must take the same step")
        self.device_name = "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"
        names = [i.name for i in self.session.get_inputs()]
        self.packed = SEQLENS in names
        if self.packed:  # the mask is followed by the cache's row lengths, not read by the graph
            expected = [t.name for t in self.io.inputs if t.name != "attention_mask"] + [SEQLENS, TOTAL, LOGITS_ROWS]
        else:
            expected = [t.name for t in self.io.inputs] + ([KEEP_INPUT] if self.variant else [])
        if names != expected:
            raise KvforgeError(f"{self.graph_path} inputs {names} differ from the manifest's IO spec {expected}")

    @property
    def prefill_level(self) -> int:
        """The accuracy level of a step that carries more than one token a row."""
        return self.accuracy_level if self.prefill_accuracy_level is None else self.prefill_accuracy_level

    def _graph_for(self, providers: list[str], level: int):
        if not self.variant:
            self.bundle.load_graph(external_data=False)  # external weights outside the bundle are refused here
            return self.bundle.graph_file
        return variant_path(self.bundle, attention=self.attention == "auto" and providers == ["CPUExecutionProvider"],
                            config=self.config, accuracy_level=level)

    def _open(self, path, providers: list[str], level: int, spinning: bool = True, shared: bool = True):
        return make_session(path, self.quant_format, providers, self.optimization, self.threads,
                            self.spinning and spinning, accuracy_level=level,
                            initializers=self.shared_weights if shared else None)

    def _session_for(self, tokens: int):
        """The session a step of `tokens` tokens a row runs on."""
        return self._prefill if tokens > 1 and self._prefill is not None else self.session

    def deactivate_impl(self) -> None:
        self.session = None
        self._prefill = None
        self.shared_weights = {}
        self._mixed = None

    def empty_cache(self, batch: int) -> KVCache:
        if not self.packed:
            return super().empty_cache(batch)
        store = packed.Store(self._zeros(batch))
        return KVCache(self.name, batch, 0, store.arrays, layout=packed.Packed(np.zeros(batch, np.int64), store))

    def _zeros(self, batch: int) -> list[np.ndarray]:
        dtype = np.float16 if self.kv_dtype == "float16" else np.float32
        return [np.zeros(self.io.empty_shape(n, batch), dtype) for n in self.past_names]

    def empty_cache_impl(self, batch: int):
        ort = _ort()
        return [ort.OrtValue.ortvalue_from_numpy(z, self.device_name, 0) for z in self._zeros(batch)]

    def forward_impl(self, input_ids, attention_mask, position_ids, cache: KVCache, last_only: bool, inputs=None):
        if (cache.layout is not None) != self.packed:
            made, runs = ("a packed", "the bundle's attention") if cache.layout is not None else ("an unpacked", "a packed cache")
            raise KvforgeError(f"this is {made} cache, and this session runs {runs} (attention={self.attention!r}, "
                               f"variant={self.variant}): continue a cache on a session loaded with the same options")
        if self.packed:
            return self._forward_packed(input_ids, attention_mask, position_ids, cache, last_only, inputs)
        session = self._session_for(input_ids.shape[1])
        binding = session.io_binding()
        for name, value in (inputs.feeds() if inputs is not None else {}).items():
            binding.bind_cpu_input(name, value)
        if self.variant:
            binding.bind_cpu_input(KEEP_INPUT, np.array([1 if last_only else input_ids.shape[1]], np.int64))
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("attention_mask", attention_mask)
        binding.bind_cpu_input("position_ids", position_ids)
        for name, value in zip(self.past_names, cache.values):
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, self.device_name)
        session.run_with_iobinding(binding)
        outputs = dict(zip(self.output_names, binding.get_outputs()))
        logits = outputs["logits"].numpy()
        if last_only and not self.variant:
            logits = logits[:, -1:]
        present = [outputs[n] for n in self.present_names]
        return logits, KVCache(self.name, cache.batch, cache.length + input_ids.shape[1], present)

    def _forward_packed(self, input_ids, attention_mask, position_ids, cache: KVCache, last_only: bool, inputs=None):
        ort = _ort()
        layout = cache.layout
        steps = packed.plan(input_ids, position_ids, attention_mask, layout.lengths, cache.length, last_only)
        store, arrays = self._writable(cache, max(int(s.total[0]) for s in steps))
        B, T = input_ids.shape
        session = self._session_for(T)  # (the caller's step: a prompt over a batch's past runs as one-token calls)
        bound = store.bindings.get(session)
        if bound is None or bound.arrays is not arrays:  # bind the buffers once: a step then rebinds its small inputs
            bound = store.bindings[session] = packed.Binding(session.io_binding(), arrays)
            self._bind_buffers(bound.binding, arrays)
        binding = bound.binding
        weights = inputs.adapter_weights if inputs is not None else None
        if weights and (bound.weights is None or any(bound.weights.get(n) is not a for n, a in weights.items())):
            for name, value in weights.items():  # the same adapter set's arrays: bound once
                binding.bind_cpu_input(name, value)
            bound.weights = weights  # (the arrays stay alive while bound)
        logits = None
        for step in steps:
            if inputs is not None:  # the step's own inputs, re-selected as the call holds the step's tokens
                for name, value in inputs.for_columns(input_ids, step.cols).step_feeds().items():
                    binding.bind_cpu_input(name, np.ascontiguousarray(value))
            for name, value in (("input_ids", step.ids), ("position_ids", step.positions), (SEQLENS, step.seqlens_k),
                                (TOTAL, step.total), (LOGITS_ROWS, step.logits_rows)):
                binding.bind_cpu_input(name, value)
            # the logits into a fresh array of this step's shape: read without wrapping every bound output
            out = np.empty((B, step.logits_rows.shape[1], self.config["vocab_size"]), np.float32)
            binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(out))
            session.run_with_iobinding(binding)
            if len(steps) == 1:
                logits = out
            elif step.logits_at:
                if logits is None:
                    logits = np.empty((B, 1 if last_only else T, out.shape[-1]), out.dtype)
                logits[:, 0 if last_only else step.logits_at[0]] = out[:, 0]
        store.version += 1
        layout = packed.Packed(steps[-1].lengths, store, store.version)
        return logits, KVCache(self.name, B, cache.length + T, arrays, layout=layout)

    def _bind_buffers(self, binding, arrays: list[np.ndarray], name=str) -> None:
        """Each cache array as both its layer's past input and present output (name(...) of them): the array's own
        memory, which a step writes in place."""
        ort = _ort()
        for past, present, array in zip(self.past_names, self.present_names, arrays):
            buffer = ort.OrtValue.ortvalue_from_numpy(array)
            binding.bind_ortvalue_input(name(past), buffer)
            binding.bind_ortvalue_output(name(present), buffer)

    def _writable(self, cache: KVCache, capacity: int) -> tuple[packed.Store, list[np.ndarray]]:
        """The store a write over `cache` goes to (its own, or a copy where another step already continued this
        cache), its buffers grown to hold `capacity` positions."""
        store = cache.layout.store  # its arrays are cache.values while no other step has continued this cache
        if cache.layout.version != store.version:
            store = packed.Store([a.copy() for a in cache.values])
        arrays = store.arrays = packed.grown(store.arrays, capacity, self.max_context)
        return store, arrays

    def prepare_mixed(self) -> bool:
        """Build (once, cached on disk) and load the mixed step's graph: a second session, holding the weights again.
        None for a graph with LoRA slots: the mixed step's one line of tokens has no rows to give adapters."""
        if not self.packed or not self.variant or self.io.extra.get("lora"):
            return False
        if self._mixed is None:  # built (and cached on disk) once, loaded beside the plain graph
            # (it carries a prompt's chunk: the prefill's level)
            path = variant_path(self.bundle, attention=True, mixed=True, config=self.config,
                                accuracy_level=self.prefill_level)
            self._mixed = self._open(path, ["CPUExecutionProvider"], self.prefill_level, shared=False) \
                if path is not None else False
        return self._mixed is not False

    def forward_mixed(self, decode, prompt, last_only: bool, inputs: tuple = (None, None)):
        (d_ids, d_mask, d_pos, d_cache), (p_ids, p_mask, p_pos, p_cache) = decode, prompt
        if inputs != (None, None) or not self._mixed or d_cache.layout is None or p_cache.layout is None or d_ids.shape[1] != 1 \
                or p_ids.shape[0] != 1 or d_cache.layout.store is p_cache.layout.store:  # (branches of one cache)
            return super().forward_mixed(decode, prompt, last_only, inputs)
        ort = _ort()
        (d_step,) = packed.plan(d_ids, d_pos, d_mask, d_cache.layout.lengths, d_cache.length, last_only)
        (p_step,) = packed.plan(p_ids, p_pos, p_mask, p_cache.layout.lengths, p_cache.length, last_only)
        d_store, d_arrays = self._writable(d_cache, int(d_step.total[0]))
        p_store, p_arrays = self._writable(p_cache, int(p_step.total[0]))
        R = d_ids.shape[0]
        binding = self._mixed.io_binding()
        self._bind_buffers(binding, d_arrays)
        self._bind_buffers(binding, p_arrays, chunk_name)
        rows = np.concatenate([d_step.logits_rows.reshape(1, -1), R + p_step.logits_rows], axis=1)
        for name, value in (("input_ids", np.concatenate([d_step.ids.reshape(1, -1), p_step.ids], axis=1)),
                            ("position_ids", np.concatenate([d_step.positions.reshape(1, -1), p_step.positions], axis=1)),
                            (SEQLENS, d_step.seqlens_k), (TOTAL, d_step.total), (CHUNK_SEQLENS, p_step.seqlens_k),
                            (CHUNK_TOTAL, p_step.total), (LOGITS_ROWS, rows)):
            binding.bind_cpu_input(name, np.ascontiguousarray(value))
        out = np.empty((1, rows.shape[1], self.config["vocab_size"]), np.float32)
        binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(out))
        self._mixed.run_with_iobinding(binding)
        caches = []
        for cache, step, store, arrays, n in ((d_cache, d_step, d_store, d_arrays, 1), (p_cache, p_step, p_store, p_arrays, p_ids.shape[1])):
            store.version += 1
            caches.append(KVCache(self.name, cache.batch, cache.length + n, arrays,
                                  layout=packed.Packed(step.lengths, store, store.version)))
        return (out[0, :R, None], caches[0]), (out[:, R:], caches[1])

    def drop_oldest(self, cache: KVCache, n: int) -> KVCache:
        if cache.layout is None:
            return super().drop_oldest(cache, n)
        # Packed rows hold no padding columns: only a row (finished) whose real positions reach that far back
        # loses any, and which of them it loses does not matter.
        lengths = np.minimum(cache.layout.lengths, cache.length - n)
        return KVCache(self.name, cache.batch, cache.length - n, cache.values, cache.owner,
                       packed.Packed(lengths, cache.layout.store, cache.layout.version))

    def rollback(self, before: KVCache, after: KVCache, length: int) -> KVCache:
        if after.layout is None:
            return super().rollback(before, after, length)
        # Packed rows: only the lengths go back; the next step overwrites the positions let go.
        lengths = np.maximum(after.layout.lengths - (after.length - length), 0)
        return KVCache(self.name, after.batch, length, after.values, after.owner,
                       packed.Packed(lengths, after.layout.store, after.layout.version))

    def regroup(self, parts, length: int) -> KVCache:
        if any((c.layout is not None) != self.packed for c, _ in parts):
            raise KvforgeError("regroup_cache takes caches this session made: packed and unpacked caches do not mix "
                               f"(this session's attention={self.attention!r})")
        if parts[0][0].layout is None:
            return super().regroup(parts, length)
        arrays, lengths = packed.regroup(parts, length)
        store = packed.Store(arrays)
        return KVCache(self.name, len(lengths), length, arrays, parts[0][0].owner, packed.Packed(lengths, store))

    def vacate(self, cache: KVCache, rows: list[int]) -> KVCache:
        if cache.layout is None:
            return super().vacate(cache, rows)
        lengths = cache.layout.lengths.copy()
        lengths[rows] = 0
        return KVCache(self.name, cache.batch, cache.length, cache.values, cache.owner,
                       packed.Packed(lengths, cache.layout.store, cache.layout.version))

    def place(self, cache: KVCache, rows: list[int], part: KVCache) -> KVCache:
        if cache.layout is None or part.layout is None:
            return super().place(cache, rows, part)
        if cache.layout.lengths[rows].any():
            raise KvforgeError(f"place() fills empty rows; rows {rows} of this cache hold positions (vacate them first)")
        held = part.layout.lengths
        store, arrays = self._writable(cache, int(held.max()))
        for a, b in zip(arrays, part.values):
            for r, i, n in zip(rows, range(part.batch), held.tolist()):
                a[r, :, :n] = b[i, :, :n]
        store.version += 1
        lengths = cache.layout.lengths.copy()
        lengths[rows] = held
        return KVCache(self.name, cache.batch, max(cache.length, part.length), arrays, cache.owner,
                       packed.Packed(lengths, store, store.version))

    def cache_arrays(self, cache: KVCache) -> list[np.ndarray]:
        if cache.layout is None:
            return super().cache_arrays(cache)
        # a capped (windowed) layer's newest W positions, as the contract holds them (the packed buffer holds all)
        held = self.tensor_lengths(cache.length, len(cache.values))
        return [packed.unpack(a, cache.layout.lengths, cache.length)[:, :, cache.length - n:]
                for a, n in zip(cache.values, held)]

    def from_arrays(self, arrays, length: int) -> KVCache:
        if not self.packed:
            return super().from_arrays(arrays, length)
        # every row holds all `length` positions: packed from index 0 already; a capped (windowed) layer's newest
        # W go to the end of its buffer, before them zeros its window never reads again
        values = []
        for a, n in zip(arrays, self.tensor_lengths(length, len(arrays))):
            v = np.zeros((*a.shape[:2], length, *a.shape[3:]), a.dtype)
            v[:, :, length - n:] = a[:, :, a.shape[2] - n:]
            values.append(v)
        store = packed.Store(values)
        return KVCache(self.name, values[0].shape[0], length, values,
                       layout=packed.Packed(np.full(values[0].shape[0], length, np.int64), store))

    def drop_oldest_impl(self, values, drops):
        ort = _ort()
        return [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, n:]), self.device_name, 0) if n else v
                for v, n in zip(values, drops)]

    def from_numpy_impl(self, arrays):
        ort = _ort()
        return [ort.OrtValue.ortvalue_from_numpy(a, self.device_name, 0) for a in arrays]

    def to_numpy(self, value) -> np.ndarray:
        return value.numpy()
