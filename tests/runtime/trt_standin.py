"""A CPU stand-in for the `tensorrt` module of one release, built from that release's API description.

The descriptions (tests/runtime/trt_api/tensorrt-<version>.json) are written by scripts/trt_api.py from
TensorRT's own pybind11 binding sources at a pinned release tag. The stand-in's surface is exactly the
release's: a class, method, property or enum member the release lacks raises AttributeError, arguments that
match none of a method's overloads (a misspelt keyword, a missing or extra argument, a keyword given to a
method bound without argument names) raise TypeError, and writing a read-only property raises
AttributeError, as the real module does.

Behind that surface, a small model of what kvforge needs from TensorRT: the ONNX parser loads the graph
(refusing operators TensorRT's parser does not take), the builder checks the profiles cover every network
input and "serializes" a plan that records the network, its typing, the builder settings and the profiles;
the runtime refuses a plan of another release; an engine's execution context runs the graph with ONNX
Runtime on the tensors at the addresses the caller binds, so a mistake in shapes, addresses or copies shows
in the numbers. What the model does not implement raises NotImplementedError naming it.
"""

from __future__ import annotations

import ctypes
import collections
import enum
import json
import types
from pathlib import Path
from typing import Any

import numpy as np

API_DIR = Path(__file__).parent / "trt_api"
RELEASES = sorted((p.stem.removeprefix("tensorrt-") for p in API_DIR.glob("tensorrt-*.json")),
                  key=lambda v: tuple(int(x) for x in v.split(".")))
PLAN_MAGIC = b"kvforge-standin-plan\n"
CACHE_MAGIC = b"kvforge-standin-timing-cache\n"


def describe(release: str) -> dict[str, Any]:
    return json.loads((API_DIR / f"tensorrt-{release}.json").read_text())


# -- the checked surface -------------------------------------------------------------------------
def _accepts(overload: dict[str, Any], args: tuple, kwargs: dict[str, Any]) -> bool:
    """Would pybind11 dispatch this call to `overload` (arguments by count and name; types are the model's job)?"""
    if not overload["named"]:
        return not kwargs and (overload["nargs"] is None or len(args) == overload["nargs"])
    names = [a["name"] for a in overload["args"]]
    if len(args) > len(names):
        return False
    given = set(names[: len(args)])
    for k in kwargs:
        if k not in names or k in given:
            return False
        given.add(k)
    return {a["name"] for a in overload["args"] if a["default"] is None} <= given


def check_call(qualname: str, overloads: list[dict[str, Any]], args: tuple, kwargs: dict[str, Any]) -> None:
    if any(_accepts(o, args, kwargs) for o in overloads):
        return
    supported = "\n".join(
        f"    {i + 1}. ({', '.join(a['name'] + ('=' + a['default'] if a['default'] else '') for a in o['args'])})"
        if o["named"] else f"    {i + 1}. ({o['nargs']} positional arguments)" for i, o in enumerate(overloads))
    raise TypeError(f"{qualname}(): incompatible function arguments. The following argument types are supported:\n"
                    f"{supported}\n\nInvoked with: args={args!r}, kwargs={kwargs!r}")


class Api:
    """One release's description, with lookups that follow the Python-visible base classes."""

    def __init__(self, release: str):
        self.release = release
        self.desc = describe(release)
        self.classes: dict[str, dict[str, Any]] = self.desc["classes"]

    def chain(self, cls: str) -> list[dict[str, Any]]:
        out, todo = [], [cls]
        while todo:
            name = todo.pop(0)
            spec = self.classes.get(name)
            if spec is not None:
                out.append(spec)
                todo += spec.get("bases", [])
        return out

    def member(self, cls: str, name: str) -> tuple[str, Any] | None:
        for spec in self.chain(cls):
            if name in spec.get("methods", {}):
                return "method", spec["methods"][name]
            if name in spec.get("properties", {}):
                return "property", spec["properties"][name]
        return None


class TrtObject:
    """An instance of a TensorRT class: every attribute read or write is checked against the release, then
    handed to the behaviour model `impl`."""

    __slots__ = ("_api", "_cls", "_impl")

    def __init__(self, api: Api, cls: str, impl: Any):
        object.__setattr__(self, "_api", api)
        object.__setattr__(self, "_cls", cls)
        object.__setattr__(self, "_impl", impl)

    def __getattr__(self, name: str):
        found = self._api.member(self._cls, name)
        if found is None:
            raise AttributeError(f"'tensorrt.{self._cls}' object has no attribute '{name}'")
        kind, spec = found
        if kind == "property" and spec == "wo":
            raise AttributeError(f"property '{name}' of 'tensorrt.{self._cls}' object has no getter")
        if not hasattr(self._impl, name):
            raise NotImplementedError(f"the stand-in TensorRT {self._api.release} does not model {self._cls}.{name}")
        value = getattr(self._impl, name)
        if kind == "property":
            return value
        qualname = f"{self._cls}.{name}"

        def call(*args, **kwargs):
            check_call(qualname, spec, args, kwargs)
            return value(*args, **kwargs)
        return call

    def __setattr__(self, name: str, value) -> None:
        found = self._api.member(self._cls, name)
        if found is None or found[0] != "property":
            raise AttributeError(f"'tensorrt.{self._cls}' object has no attribute '{name}'")
        if found[1] == "ro":
            raise AttributeError(f"property '{name}' of 'tensorrt.{self._cls}' object has no setter")
        setattr(self._impl, name, value)

    def __repr__(self) -> str:
        return f"<tensorrt.{self._cls} (stand-in {self._api.release})>"


class HostMemory(TrtObject):
    """IHostMemory, which the real module exposes through the buffer protocol: bytes(memory) gives its contents."""

    __slots__ = ()

    def __bytes__(self) -> bytes:
        return bytes(self._impl.data)


def impl_of(obj):
    """The behaviour object behind a stand-in TensorRT object (what a C++ method receives)."""
    return object.__getattribute__(obj, "_impl") if isinstance(obj, TrtObject) else obj


class _ClassMeta(type):
    """Class-level lookups (nested enums, exported enum values, static members) checked like instance ones."""

    def __getattr__(cls, name: str):
        raise AttributeError(f"type object 'tensorrt.{cls.__name__}' has no attribute '{name}'")


def _enum(name: str, members: list[str]) -> type[enum.IntEnum]:
    return enum.IntEnum(name.rpartition(".")[2], members, start=0)


class StandInTensorRT(types.ModuleType):
    """The `tensorrt` module of one release. `factories` (filled after construction: the behaviour model needs
    the module) maps the names of classes a user constructs to factories of behaviour objects."""

    def __init__(self, release: str):
        super().__init__("tensorrt")
        api = Api(release)
        self.__dict__["_api"] = api
        self.__dict__["__version__"] = api.desc.get("header_version") or release
        self.__dict__["_state"] = types.SimpleNamespace(plans=[], parsed=[], loggers=[])
        self.__dict__["_factories"] = {}
        enums = {n: _enum(n, e["members"]) for n, e in api.desc["enums"].items()}
        for name, spec in api.classes.items():
            if "." in name:
                continue
            self.__dict__[name] = self._make_class(api, name, spec, self._factories)
        for name, e in enums.items():
            scope, _, short = name.rpartition(".")
            if scope:
                target = self.__dict__.get(scope)
                if target is not None:
                    type.__setattr__(target, short, e)
                    if api.desc["enums"][name].get("export_values"):
                        for member in e:
                            type.__setattr__(target, member.name, member)
            else:
                self.__dict__[name] = e
        for name, spec in api.classes.items():  # python-level aliases such as Logger.Severity
            for attr, info in spec.get("attributes", {}).items():
                if info.get("kind") in ("alias", "enum_value") and name in self.__dict__:
                    e = enums.get(info["of"])
                    if e is not None:
                        type.__setattr__(self.__dict__[name], attr, e if info["kind"] == "alias" else e[attr])

    @staticmethod
    def _make_class(api: Api, name: str, spec: dict[str, Any], factories: dict[str, Any]) -> type:
        if name in ("ILogger", "IErrorRecorder", "IOutputAllocator", "IGpuAllocator", "IProgressMonitor"):
            # interfaces users subclass: a real class whose constructor takes what the release's does
            overloads = spec.get("init") or []

            def __init__(self, *args, **kwargs):
                check_call(f"{name}.__init__", overloads, args, kwargs)

            return _ClassMeta(name, (), {"__init__": __init__})
        wrapper = HostMemory if spec.get("buffer_protocol") else TrtObject

        def __new__(cls, *args, **kwargs):
            if not spec.get("init"):
                raise TypeError(f"tensorrt.{name}: No constructor defined!")
            check_call(f"{name}.__init__", spec["init"], args, kwargs)
            if name not in factories:
                raise NotImplementedError(f"the stand-in TensorRT {api.release} does not model constructing {name}")
            return wrapper(api, name, factories[name](*args, **kwargs))

        return _ClassMeta(name, (), {"__new__": __new__})

    def __getattr__(self, name: str):
        raise AttributeError(f"module 'tensorrt' has no attribute '{name}'")

    def wrap(self, cls: str, impl: Any) -> TrtObject:
        spec = self._api.classes[cls]
        return (HostMemory if spec.get("buffer_protocol") else TrtObject)(self._api, cls, impl)


# -- the behaviour model -------------------------------------------------------------------------------
class _Behaviour:
    def __init__(self, trt: StandInTensorRT):
        self.trt = trt

    def log(self, logger, severity: str, msg: str) -> None:
        impl_of(logger).log(getattr(self.trt.ILogger.Severity, severity), msg)


def _onnx_dtype_name(elem_type: int) -> str:
    from onnx import TensorProto

    return {TensorProto.FLOAT: "FLOAT", TensorProto.FLOAT16: "HALF", TensorProto.BFLOAT16: "BF16",
            TensorProto.INT64: "INT64", TensorProto.INT32: "INT32", TensorProto.BOOL: "BOOL", TensorProto.INT8: "INT8",
            TensorProto.UINT8: "UINT8"}[elem_type]


def build_behaviours(trt: StandInTensorRT) -> dict[str, Any]:
    """The factories behind the classes kvforge constructs (Builder, OnnxParser, Runtime)."""
    from onnxruntime import InferenceSession

    B = _Behaviour(trt)
    state = trt._state

    class Tensor:
        def __init__(self, name: str, dtype: str):
            self.name = name
            self.dtype = getattr(trt.DataType, dtype)

    class Network:
        def __init__(self, flags: int):
            known = 0
            for member in trt.NetworkDefinitionCreationFlag:
                known |= 1 << int(member)
            if flags & ~known:
                raise TypeError(f"create_network: flags {flags:#x} name no NetworkDefinitionCreationFlag of this release")
            strongly = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
            # TensorRT 11 types every network strongly; in 10 the flag asks for it
            self.strongly_typed = int(trt.__version__.split(".")[0]) >= 11 or (
                strongly is not None and bool(flags & (1 << int(strongly))))
            self.flags = flags
            self.onnx_path: str | None = None
            self.inputs: list[Tensor] = []
            self.outputs: list[Tensor] = []

        @property
        def num_inputs(self) -> int:
            return len(self.inputs)

        @property
        def num_outputs(self) -> int:
            return len(self.outputs)

        def get_input(self, index: int):
            return trt.wrap("ITensor", self.inputs[index])

        def get_output(self, index: int):
            return trt.wrap("ITensor", self.outputs[index])

    class ParserErrorImpl:
        def __init__(self, node: str, desc: str):
            self._node, self._desc = node, desc

        def desc(self):
            return self._desc

        def node_name(self):
            return self._node

        def __str__(self):
            return f"In node {self._node}: {self._desc}"

    class OnnxParser:
        def __init__(self, network, logger):
            self.network = impl_of(network)
            self.logger = logger
            self.errors: list[ParserErrorImpl] = []

        @property
        def num_errors(self) -> int:
            return len(self.errors)

        def get_error(self, index: int):
            return trt.wrap("ParserError", self.errors[index])

        def parse_from_file(self, model: str) -> bool:
            import onnx

            from kvforge.export.trt_ops import SUPPORTED_OPS

            if not isinstance(model, str):
                raise TypeError(f"OnnxParser.parse_from_file(): model must be a str path, got {type(model).__name__}")
            graph = onnx.load(model, load_external_data=False).graph
            for node in graph.node:
                if node.domain not in ("", "ai.onnx") or node.op_type not in SUPPORTED_OPS:
                    self.errors.append(ParserErrorImpl(node.name, f"No importer registered for op: {node.op_type}"))
            if self.errors:
                return False
            inits = {i.name for i in graph.initializer}
            net = self.network
            net.onnx_path = model
            net.inputs = [Tensor(v.name, _onnx_dtype_name(v.type.tensor_type.elem_type)) for v in graph.input if v.name not in inits]
            net.outputs = [Tensor(v.name, _onnx_dtype_name(v.type.tensor_type.elem_type)) for v in graph.output]
            state.parsed.append(net)
            return True

    class Profile:
        def __init__(self):
            self.shapes: dict[str, tuple] = {}

        def set_shape(self, input, min, opt, max):
            boxes = [tuple(int(d) for d in s) for s in (min, opt, max)]
            if not all(len(b) == len(boxes[0]) for b in boxes) or not all(
                    lo <= o <= hi for lo, o, hi in zip(*boxes)):
                raise ValueError(f"IOptimizationProfile.set_shape: {input}: need min <= opt <= max, got {boxes}")
            self.shapes[input] = boxes

    class TimingCache:
        def __init__(self, entries: int):
            self.entries = entries

        def serialize(self):
            return trt.wrap("IHostMemory", types.SimpleNamespace(data=CACHE_MAGIC + json.dumps(
                {"release": trt.__version__, "entries": self.entries}).encode()))

    class Config:
        def __init__(self):
            self.flags = {member.name for member in trt.BuilderFlag if member.name == "TF32"}  # TF32 is on by default
            self.builder_optimization_level = 3
            self.hardware_compatibility_level = trt.HardwareCompatibilityLevel.NONE
            self.profiles: list[Profile] = []
            self.timing_cache: TimingCache | None = None

        def _flag(self, flag) -> str:
            if not isinstance(flag, trt.BuilderFlag):
                raise TypeError(f"IBuilderConfig flag must be a tensorrt.BuilderFlag, got {flag!r}")
            return flag.name

        def set_flag(self, flag):
            self.flags.add(self._flag(flag))

        def clear_flag(self, flag):
            self.flags.discard(self._flag(flag))

        def get_flag(self, flag) -> bool:
            return self._flag(flag) in self.flags

        def add_optimization_profile(self, profile) -> int:
            self.profiles.append(impl_of(profile))
            return len(self.profiles) - 1

        def create_timing_cache(self, serialized_timing_cache):
            data = bytes(serialized_timing_cache)
            if not data:
                return trt.wrap("ITimingCache", TimingCache(0))
            if not data.startswith(CACHE_MAGIC):
                return None  # TensorRT logs that the cache is damaged
            meta = json.loads(data[len(CACHE_MAGIC):])
            cache = TimingCache(meta["entries"])
            cache.release = meta["release"]
            return trt.wrap("ITimingCache", cache)

        def set_timing_cache(self, cache, ignore_mismatch) -> bool:
            cache = impl_of(cache)
            if getattr(cache, "release", trt.__version__) != trt.__version__ and not ignore_mismatch:
                return False
            self.timing_cache = cache
            return True

        def get_timing_cache(self):
            return trt.wrap("ITimingCache", self.timing_cache) if self.timing_cache is not None else None

    class Builder:
        def __init__(self, logger):
            self.logger = logger
            state.loggers.append(logger)

        def create_network(self, flags=0):
            return trt.wrap("INetworkDefinition", Network(int(flags)))

        def create_builder_config(self):
            return trt.wrap("IBuilderConfig", Config())

        def create_optimization_profile(self):
            return trt.wrap("IOptimizationProfile", Profile())

        def build_serialized_network(self, network, config, kernel_text=None):
            net, cfg = impl_of(network), impl_of(config)
            if net.onnx_path is None:
                B.log(self.logger, "ERROR", "the network is empty: nothing was parsed into it")
                return None
            if not cfg.profiles:
                B.log(self.logger, "ERROR", "Network has dynamic or shape inputs, but no optimization profile has been defined.")
                return None
            for i, prof in enumerate(cfg.profiles):
                missing = [t.name for t in net.inputs if t.name not in prof.shapes]
                if missing:
                    B.log(self.logger, "ERROR", f"optimization profile {i} sets no shape for the inputs {missing}")
                    return None
            if cfg.timing_cache is not None:
                cfg.timing_cache.entries += 1
            plan = {
                "release": trt.__version__, "onnx": net.onnx_path, "strongly_typed": net.strongly_typed,
                "flags": sorted(cfg.flags), "builder_optimization_level": cfg.builder_optimization_level,
                "hardware_compatibility_level": cfg.hardware_compatibility_level.name,
                "profiles": [{n: list(map(list, box)) for n, box in p.shapes.items()} for p in cfg.profiles],
                "inputs": [(t.name, t.dtype.name) for t in net.inputs], "outputs": [(t.name, t.dtype.name) for t in net.outputs],
            }
            state.plans.append(plan)
            return trt.wrap("IHostMemory", types.SimpleNamespace(data=PLAN_MAGIC + json.dumps(plan).encode()))

    class Context:
        def __init__(self, engine):
            self.engine = engine
            self.session = InferenceSession(engine.plan["onnx"], providers=["CPUExecutionProvider"])
            self.profile, self.switches, self.shapes, self.addresses = 0, 0, {}, {}
            self.out_shapes: dict[tuple, dict[str, tuple]] = {}

        def set_optimization_profile_async(self, profile_index, stream_handle) -> bool:
            if not 0 <= profile_index < len(self.engine.plan["profiles"]):
                return False
            self.switches += profile_index != self.profile
            self.profile = profile_index
            return True

        def set_input_shape(self, name, shape) -> bool:
            box = self.engine.plan["profiles"][self.profile].get(name)
            if box is None:
                raise RuntimeError(f"{name} is not an input of this engine")
            self.shapes[name] = tuple(int(d) for d in shape)
            return len(shape) == len(box[0]) and all(lo <= v <= hi for v, lo, hi in zip(shape, box[0], box[2]))

        def get_tensor_shape(self, name):
            key = tuple(sorted(self.shapes.items()))
            if key not in self.out_shapes:  # what the graph computes for these shapes (TensorRT infers it)
                feeds = {n: np.zeros(self.shapes[n], _NP[d]) for n, d in self.engine.plan["inputs"]}
                names = [n for n, _ in self.engine.plan["outputs"]]
                self.out_shapes[key] = {n: a.shape for n, a in zip(names, self.session.run(names, feeds))}
            return Dims(self.out_shapes[key].get(name, self.shapes.get(name)))

        def set_tensor_address(self, name, memory) -> bool:
            self.addresses[name] = int(memory)
            return True

        def execute_async_v3(self, stream_handle) -> bool:
            feeds = {n: host_array(self.addresses[n], self.shapes[n], _NP[d]).copy() for n, d in self.engine.plan["inputs"]}
            names = [n for n, _ in self.engine.plan["outputs"]]
            for name, value in zip(names, self.session.run(names, feeds)):
                out = host_array(self.addresses[name], value.shape, value.dtype)
                out[...] = value
            return True

    class Engine:
        def __init__(self, plan: dict):
            self.plan = plan
            self.names = [n for n, _ in plan["inputs"]] + [n for n, _ in plan["outputs"]]
            self.dtypes = dict(plan["inputs"] + plan["outputs"])

        @property
        def num_io_tensors(self) -> int:
            return len(self.names)

        @property
        def num_optimization_profiles(self) -> int:
            return len(self.plan["profiles"])

        def get_tensor_name(self, index):
            return self.names[index]

        def get_tensor_mode(self, name):
            inputs = {n for n, _ in self.plan["inputs"]}
            return trt.TensorIOMode.INPUT if name in inputs else trt.TensorIOMode.OUTPUT if name in self.dtypes else trt.TensorIOMode.NONE

        def get_tensor_dtype(self, name):
            return getattr(trt.DataType, self.dtypes[name])

        def create_execution_context(self, strategy=None, runtime_config=None):
            return trt.wrap("IExecutionContext", Context(self))

    class Runtime:
        def __init__(self, logger):
            self.logger = logger
            self.engine_host_code_allowed = False

        def deserialize_cuda_engine(self, serialized_engine):
            data = bytes(serialized_engine)
            if not data.startswith(PLAN_MAGIC):
                B.log(self.logger, "ERROR", "Error Code 1: Serialization (Serialization assertion magicTagRead == kMAGIC_TAG failed.)")
                return None
            plan = json.loads(data[len(PLAN_MAGIC):])
            if plan["release"] != trt.__version__:
                B.log(self.logger, "ERROR", f"The engine plan file is not compatible with this version of TensorRT, expecting "
                                           f"library version {trt.__version__} got {plan['release']}")
                return None
            return trt.wrap("ICudaEngine", Engine(plan))

    return {"Builder": Builder, "OnnxParser": OnnxParser, "Runtime": Runtime}


class Dims:
    """tensorrt.Dims as the real module gives it: a sequence by __len__ and __getitem__ (IndexError past the end),
    no __iter__, no tuple methods."""

    def __init__(self, shape):
        self._shape = tuple(int(d) for d in shape)

    def __len__(self) -> int:
        return len(self._shape)

    def __getitem__(self, index: int) -> int:
        if not -len(self._shape) <= index < len(self._shape):
            raise IndexError("Out of bounds")
        return self._shape[index]

    def __repr__(self) -> str:
        return f"({', '.join(map(str, self._shape))})"


_NP = {"FLOAT": np.float32, "HALF": np.float16, "INT64": np.int64, "INT32": np.int32, "BOOL": np.bool_, "INT8": np.int8,
       "UINT8": np.uint8}


def host_array(ptr: int, shape, dtype) -> np.ndarray:
    """The array of `shape` at host address `ptr` (the stand-in's device memory is host memory)."""
    count = int(np.prod(shape, dtype=np.int64))
    n = count * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * max(n, 1)).from_address(ptr), dtype, count=count).reshape(shape)


def tensorrt(release: str) -> StandInTensorRT:
    """The stand-in `tensorrt` module of `release` (one of RELEASES)."""
    trt = StandInTensorRT(release)
    trt._factories.update(build_behaviours(trt))
    return trt


class HostCuda:
    """polygraphy.cuda's surface as the backend uses it, on host memory (no GPU)."""

    class MemcpyKind:
        HostToHost, HostToDevice, DeviceToHost, DeviceToDevice = 0, 1, 2, 3

    def __init__(self):
        self.live: dict[int, np.ndarray] = {}
        self.allocations = 0
        self.copies = collections.Counter()
        cuda = self

        class DeviceArray:
            @staticmethod
            def raw(shape):
                arr = DeviceArray()
                arr.buf = np.full(int(shape[0]), 0xAB, np.uint8)  # garbage, as cudaMalloc gives
                arr.ptr = arr.buf.ctypes.data
                cuda.live[arr.ptr] = arr.buf
                cuda.allocations += 1
                return arr

            def free(self):
                cuda.live.pop(self.ptr)

        class Stream:
            def __init__(self):
                self.ptr = 0x5EED

            def synchronize(self):
                pass

            def free(self):
                self.ptr = 0

        class Wrapper:
            def memcpy(self, dst, src, nbytes, kind, stream_ptr=None):
                cuda.copies[kind] += 1
                ctypes.memmove(dst, src, nbytes)

        self.DeviceArray, self.Stream, self._wrapper = DeviceArray, Stream, Wrapper()

    def wrapper(self):
        return self._wrapper
