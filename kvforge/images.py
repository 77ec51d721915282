"""Images for vision-language models: read from a path, bytes or a data URL, and preprocessed into pixel_values
as the family's Hugging Face image processor does, with Pillow and NumPy only (no Torch; issue 37).

The processing is read from the checkpoint's preprocessor_config.json (`ImageProcessing.from_hf`) and recorded in
the bundle. CLIP's processor (LLaVA's): convert to RGB (transparency composited onto white), resize (the shortest
edge to `size["shortest_edge"]`, the other in proportion and truncated, or to `size["height"] x size["width"]`)
with Pillow's resampling filter, center crop (zero-padded where the image is smaller), rescale (x 1/255, in
float64 then float32), normalize per channel ((x - mean) / std in float32). Pillow does the resizing, as in
transformers' Pillow backend, so pixel_values agree with it to float32 rounding.

Idefics2's: the size bounded to shortest_edge..longest_edge keeping the aspect (each image keeps a size of its
own; the processor's padding to a batch's largest image, with a pixel mask, changes no feature and is not done),
and when splitting, the four quarters and then the whole image, each resized. Idefics3's (SmolVLM): the longest
edge resized in proportion (even sides), then both sides rounded up to whole max_image_size tiles, the tiles in
reading order and the whole image at the tile size (or only the latter, unsplit). prompt_with_images writes the
text each family's processor puts in a prompt for an image.

Options a processor has that change its output and that are not built here are refused by name rather than
ignored.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import KvforgeError

PROCESSORS = ("CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil", "Idefics2ImageProcessor",
              "Idefics2ImageProcessorFast", "Idefics2ImageProcessorPil", "Idefics3ImageProcessor",
              "Idefics3ImageProcessorFast", "Idefics3ImageProcessorPil", "Qwen2VLImageProcessor",
              "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
# what Idefics3's processor does where its preprocessor_config.json does not say (transformers' class defaults)
_IDEFICS3_DEFAULTS = dict(size={"longest_edge": 4 * 364}, max_image_size={"longest_edge": 364}, do_image_splitting=True,
                          do_center_crop=False, resample=1, image_mean=[0.5] * 3, image_std=[0.5] * 3)
_IDEFICS2_DEFAULTS = dict(size={"shortest_edge": 378, "longest_edge": 980}, do_image_splitting=False,
                          do_center_crop=False, resample=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
# Qwen2-VL's (its min/max pixels given as size's shortest/longest edge, as transformers 5 reads them)
_QWEN2_VL_DEFAULTS = dict(size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}, do_center_crop=False,
                          resample=3, patch_layout={"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2})
MAX_IMAGE_SIDE = 4096  # Idefics3's processor keeps a resized image's sides within this
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"  # what Idefics2/3's processors write around an image
_OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
# keys of a preprocessor_config.json that say nothing about the pixels (or that this processing reads)
_INERT = {"image_processor_type", "processor_class", "feature_extractor_type", "data_format", "input_data_format",
          "return_tensors", "device", "disable_grouping", "default_to_square", "image_seq_length", "patch_size",
          "vision_feature_select_strategy", "num_additional_image_tokens", "use_square_size", "backend"}
# Idefics2/3's: they pad a batch's images to one size with a pixel mask the model reads; kvforge runs each size
# apart (unpadded), which gives the model the same features
_IDEFICS_INERT = {"do_pad", "return_row_col_info"}
_QWEN2_VL_READ = {"temporal_patch_size", "merge_size", "min_pixels", "max_pixels"}  # read into patch_layout, size


def _pil():
    try:
        from PIL import Image
    except ImportError as e:  # a dependency of kvforge: only a broken install lacks it
        raise KvforgeError("reading images needs Pillow (pip install pillow)") from e
    return Image


@dataclass
class ImageProcessing:
    """What turns an image into pixel_values (CLIP's processor; field names as preprocessor_config.json's)."""

    size: dict[str, int] = field(default_factory=lambda: {"shortest_edge": 224})
    crop_size: dict[str, int] = field(default_factory=lambda: {"height": 224, "width": 224})
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    resample: int = 3  # Pillow's filter: 3 = BICUBIC (CLIP's), 2 = BILINEAR
    rescale_factor: float = 1 / 255
    image_mean: list[float] = field(default_factory=lambda: list(_OPENAI_CLIP_MEAN))
    image_std: list[float] = field(default_factory=lambda: list(_OPENAI_CLIP_STD))
    # Idefics3's: after the resize, each image becomes max_image_size squares: its tiles (rows x cols, in reading
    # order) and the whole image resized (do_image_splitting), or only the latter
    max_image_size: dict[str, int] | None = None
    do_image_splitting: bool = False
    # Qwen2-VL's: {"patch_size", "temporal_patch_size", "merge_size"}: size's shortest/longest edge are then the
    # least and most pixels; the image is resized to whole merge blocks of patches (smart_resize) and given to
    # the encoder as its patches, flattened and laid out block by block: (rows, cols, C*T*P*P)
    patch_layout: dict[str, int] | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.do_resize and not (set(self.size) in ({"shortest_edge"}, {"longest_edge"}, {"height", "width"},
                                                      {"shortest_edge", "longest_edge"})):
            problems.append(f"size={self.size}: kvforge resizes to a shortest or longest edge (or both: Idefics2's "
                            "bounds) or to a height and width")
        if self.max_image_size is not None:
            if set(self.max_image_size) != {"longest_edge"} or not isinstance(self.max_image_size["longest_edge"], int):
                problems.append(f"max_image_size={self.max_image_size} needs an integer longest_edge")
            if self.do_center_crop:
                problems.append("max_image_size (tiles) and do_center_crop do not go together")

        if self.do_center_crop and set(self.crop_size) != {"height", "width"}:
            problems.append(f"crop_size={self.crop_size} needs height and width")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if isinstance(value, (int, float)):
                setattr(self, name, [float(value)] * 3)
            elif isinstance(value, (list, tuple)) and len(value) == 3:
                setattr(self, name, [float(v) for v in value])
            else:
                problems.append(f"{name}={value!r} is not three channel values")
        if any(s == 0 for s in self.image_std if isinstance(self.image_std, list)):
            problems.append("image_std has a zero")
        if self.resample not in (0, 1, 2, 3, 4, 5):
            problems.append(f"resample={self.resample!r} is not one of Pillow's filters (0..5)")
        if problems:
            raise KvforgeError("image processing: " + "; ".join(problems))

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "ImageProcessing":
        """From a checkpoint's preprocessor_config.json (CLIP's image processor)."""
        kind = config.get("image_processor_type", "CLIPImageProcessor")
        if kind not in PROCESSORS:
            raise KvforgeError(f"image_processor_type={kind!r} is not one kvforge reproduces ({list(PROCESSORS)})")
        known = {f for f in cls.__dataclass_fields__}
        inert = _INERT | (_IDEFICS_INERT if kind.startswith("Idefics") else set()) | \
            (_QWEN2_VL_READ if kind.startswith("Qwen2VL") else set())
        unknown = sorted(k for k in config if k not in known and k not in inert)
        if unknown:
            raise KvforgeError(f"the image processor's options {unknown} change pixel_values in ways kvforge does not "
                               "reproduce")
        if config.get("default_to_square") and "shortest_edge" in (config.get("size") or {}):
            raise KvforgeError("default_to_square with a shortest_edge size is not reproduced")
        defaults = _IDEFICS3_DEFAULTS if kind.startswith("Idefics3") else \
            _IDEFICS2_DEFAULTS if kind.startswith("Idefics2") else _QWEN2_VL_DEFAULTS if kind.startswith("Qwen2VL") else {}
        given = {k: v for k, v in config.items() if k in known}
        if kind.startswith("Qwen2VL"):
            layout = dict(defaults["patch_layout"])
            layout.update({k: config[k] for k in layout if k in config})
            size = dict(config.get("size") or defaults["size"])
            if config.get("min_pixels") is not None:
                size["shortest_edge"] = config["min_pixels"]
            if config.get("max_pixels") is not None:
                size["longest_edge"] = config["max_pixels"]
            given.update(patch_layout=layout, size=size)
        return cls(**{**defaults, **given})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def variable_size(self) -> bool:
        """Each image keeps a size of its own (Idefics2's bounded resize): the image encoder takes any size."""
        try:
            self.output_size
        except KvforgeError:
            return True
        return False

    @property
    def output_size(self) -> tuple[int, int]:
        """(height, width) of the pixel_values this gives."""
        if self.patch_layout is not None:
            raise KvforgeError("this image processing gives each image the patch grid of its own size")
        if self.max_image_size is not None:
            return (self.max_image_size["longest_edge"],) * 2
        if self.do_center_crop:
            return self.crop_size["height"], self.crop_size["width"]
        if self.do_resize and "height" in self.size:
            return self.size["height"], self.size["width"]
        raise KvforgeError("this image processing keeps each image's own size")

    @property
    def side_bounds(self) -> tuple[int, int] | None:
        """(shortest, longest) side a tile can have where each image keeps its size (Idefics2's bounds), else None."""
        if not self.variable_size:
            return None
        if self.patch_layout is not None:  # a side of the patch grid: a merge block .. the most pixels in one row
            p, m = self.patch_layout["patch_size"], self.patch_layout["merge_size"]
            return m, max(m, self.size["longest_edge"] // (p * p * m) // m * m)
        if self.do_resize and set(self.size) == {"shortest_edge", "longest_edge"}:
            low = self.size["shortest_edge"]
            return low, max(low, self.size["longest_edge"])
        return 1, MAX_IMAGE_SIDE

    @property
    def max_tiles(self) -> int:
        """The most pixel_values one image can make: its tiles and the whole image, or one."""
        if not self.do_image_splitting:
            return 1
        longest = self.size.get("longest_edge", MAX_IMAGE_SIDE) if self.do_resize else MAX_IMAGE_SIDE
        per_side = math.ceil(min(longest, MAX_IMAGE_SIDE) / self.max_image_size["longest_edge"])
        return per_side * per_side + 1 if per_side > 1 else 1

    def __call__(self, images: list[Any]) -> np.ndarray:
        """pixel_values (N, 3, H, W) float32 of images (Pillow images, paths, bytes or data URLs): one per image, or
        each image's tiles in turn where it is split (process() says how)."""
        return self.process(images)[0]

    def process(self, images: list[Any]) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """(pixel_values of every image's tiles, each image's (rows, cols) of tiles: (0, 0) for an image that is
        one tile (unsplit, or too small to split); else rows x cols tiles and then the whole image). Images that
        keep sizes of their own: process_tiles()."""
        tiles, grids = self.process_tiles(images)
        if len({t.shape for t in tiles}) > 1:
            raise KvforgeError("these images keep sizes of their own: use process_tiles()")
        return np.stack(tiles).astype(np.float32, copy=False), grids

    def process_tiles(self, images: list[Any]) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
        """process() with each tile's pixel_values (3, H, W) on its own (their sizes may differ)."""
        tiles, grids = [], []
        for im in images:
            parts, grid = self.tiles(load_image(im))
            tiles += parts
            grids.append(grid)
        return tiles, grids

    def prompt_grid(self, image) -> tuple[int, int]:
        """What a prompt's text for an image depends on: its tiles (grid()), or for Qwen2-VL its image tokens'
        (rows, cols): the patch grid in merge blocks."""
        if self.patch_layout is None:
            return self.grid(image)
        image = load_image(image)
        m = self.patch_layout["merge_size"]
        rows, cols = self._patch_grid(image.height, image.width)
        return rows // m, cols // m

    def token_grid(self, tile) -> tuple[int, int]:
        """The image-token grid (rows, cols) of one preprocessed Qwen2-VL image, (rows, cols, C*T*P*P): its patch
        grid in merge blocks."""
        m = self.patch_layout["merge_size"]
        return tile.shape[0] // m, tile.shape[1] // m

    def image_tokens(self, image, per_tile: int) -> int:
        """The image tokens an image stands for in a prompt (per_tile: a fixed-size tile's)."""
        if self.patch_layout is not None:
            rows, cols = self.prompt_grid(image)
            return rows * cols
        rows, cols = self.grid(image)
        return (rows * cols + 1 if rows else 1) * per_tile

    def _patch_grid(self, height: int, width: int) -> tuple[int, int]:
        h, w = self._resized(height, width) if self.do_resize else (height, width)
        return h // self.patch_layout["patch_size"], w // self.patch_layout["patch_size"]

    def grid(self, image) -> tuple[int, int]:
        """An image's (rows, cols) of tiles, from its size alone (Idefics2's split: always its four quarters)."""
        if not self.do_image_splitting:
            return 0, 0
        if self.max_image_size is None:
            return 2, 2
        image = load_image(image)
        h, w = self._split_size(*self._resized(image.height, image.width))
        side = self.max_image_size["longest_edge"]
        return (h // side, w // side) if h > side or w > side else (0, 0)

    def tiles(self, image) -> tuple[list[np.ndarray], tuple[int, int]]:
        """One Pillow image's pixel_values (3, H, W), one per tile in order, and its (rows, cols) of tiles."""
        if self.do_convert_rgb:
            image = to_rgb(image)
        elif image.mode not in ("RGB",):
            raise KvforgeError(f"an image in mode {image.mode!r} with do_convert_rgb off: kvforge takes RGB")
        if self.patch_layout is not None:  # Qwen2-VL's: resized to whole merge blocks, then its patches
            if self.do_resize:
                image = image.resize(self._resized(image.height, image.width)[::-1], resample=self.resample)
            return [self._patches(self._pixels(image))], (0, 0)
        if self.max_image_size is None:  # Idefics2's split: the four quarters and the whole, each resized
            parts = [image]
            if self.do_image_splitting:
                w, h = image.size
                boxes = [(0, 0, w // 2, h // 2), (w // 2, 0, w, h // 2), (0, h // 2, w // 2, h), (w // 2, h // 2, w, h)]
                parts = [image.crop(box) for box in boxes] + [image]
            if self.do_resize:
                parts = [p.resize(self._resized(p.height, p.width)[::-1], resample=self.resample) for p in parts]
            return [self._pixels(p) for p in parts], ((2, 2) if self.do_image_splitting else (0, 0))
        if self.do_resize:
            image = image.resize(self._resized(image.height, image.width)[::-1], resample=self.resample)
        side = self.max_image_size["longest_edge"]
        if not self.do_image_splitting:
            return [self._pixels(image.resize((side, side), resample=self.resample))], (0, 0)
        h, w = self._split_size(image.height, image.width)
        image = image.resize((w, h), resample=self.resample)
        if h <= side and w <= side:
            return [self._pixels(image)], (0, 0)
        rows, cols = h // side, w // side
        parts = [self._pixels(image.crop((c * side, r * side, (c + 1) * side, (r + 1) * side)))
                 for r in range(rows) for c in range(cols)]
        return parts + [self._pixels(image.resize((side, side), resample=self.resample))], (rows, cols)

    def _patches(self, x: np.ndarray) -> np.ndarray:
        """(C, H, W) -> (rows, cols, C*T*P*P): each patch repeated over the temporal window and flattened, the
        patches laid out merge block by merge block (Qwen2-VL's processor's order; rows, cols just shape it)."""
        p, t, m = (self.patch_layout[k] for k in ("patch_size", "temporal_patch_size", "merge_size"))
        c, h, w = x.shape
        rows, cols = h // p, w // p
        blocks = x.astype(np.float32).reshape(c, rows // m, m, p, cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        blocks = np.broadcast_to(blocks[:, :, :, :, :, None], blocks.shape[:5] + (t,) + blocks.shape[5:])
        return np.ascontiguousarray(blocks).reshape(rows, cols, c * t * p * p)

    def _split_size(self, height: int, width: int) -> tuple[int, int]:
        """Idefics3's resize for splitting: both sides rounded up to whole tiles, the shorter in proportion first."""
        side = self.max_image_size["longest_edge"]
        aspect = width / height
        if width >= height:
            width = math.ceil(width / side) * side
            height = math.ceil(int(width / aspect) / side) * side
        else:
            height = math.ceil(height / side) * side
            width = math.ceil(int(height * aspect) / side) * side
        return height, width

    def _pixels(self, image) -> np.ndarray:
        x = np.moveaxis(np.asarray(image), -1, 0)  # (C, H, W) uint8
        if self.do_center_crop:
            x = center_crop(x, self.crop_size["height"], self.crop_size["width"])
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            x = x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float32)
            mean = np.asarray(self.image_mean, x.dtype)[:, None, None]
            std = np.asarray(self.image_std, x.dtype)[:, None, None]
            x = (x - mean) / std
        return x

    def _resized(self, height: int, width: int) -> tuple[int, int]:
        if self.patch_layout is not None:  # Qwen2-VL's smart_resize: whole merge blocks, pixels within bounds
            factor = self.patch_layout["patch_size"] * self.patch_layout["merge_size"]
            low, high = self.size["shortest_edge"], self.size["longest_edge"]
            if max(height, width) / min(height, width) > 200:
                raise KvforgeError(f"an image of {width} x {height}: Qwen2-VL's processing takes aspect ratios up to 200")
            h, w = round(height / factor) * factor, round(width / factor) * factor
            if h * w > high:
                beta = math.sqrt(height * width / high)
                h = max(factor, math.floor(height / beta / factor) * factor)
                w = max(factor, math.floor(width / beta / factor) * factor)
            elif h * w < low:
                beta = math.sqrt(low / (height * width))
                h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
            return h, w
        if "height" in self.size:
            return self.size["height"], self.size["width"]
        if "shortest_edge" in self.size and "longest_edge" in self.size:  # Idefics2's bounds
            low, high = self.size["shortest_edge"], self.size["longest_edge"]
            aspect = width / height
            if width >= height and width > high:
                width, height = high, int(high / aspect)
            elif height > width and height > high:
                height, width = high, int(high * aspect)
            return max(height, low), max(width, low)
        if "longest_edge" in self.size:  # Idefics3's: the longer side to it, the other in proportion and even
            target = self.size["longest_edge"]
            if width >= height:
                width, height = target, int(target / (width / height))
                height += height % 2
            else:
                height, width = target, int(target * (width / height))
                width += width % 2
            height, width = max(height, 1), max(width, 1)
            if max(height, width) > MAX_IMAGE_SIDE:  # within the processor's upper bound, in proportion
                aspect = width / height
                if width >= height:
                    width, height = MAX_IMAGE_SIDE, max(int(MAX_IMAGE_SIDE / aspect), 1)
                else:
                    height, width = MAX_IMAGE_SIDE, max(int(MAX_IMAGE_SIDE * aspect), 1)
            return height, width
        target = self.size["shortest_edge"]
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(target * long / short)
        return (new_long, target) if width <= height else (target, new_long)


def to_rgb(image):
    """RGB, with any transparency composited onto white (as transformers converts)."""
    Image = _pil()
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """(C, H, W) cropped about its center to (C, height, width), zero-padded where it is smaller."""
    h, w = x.shape[-2:]
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0 and top + height <= h and left + width <= w:
        return x[..., top:top + height, left:left + width]
    new_h, new_w = max(height, h), max(width, w)
    padded = np.zeros(x.shape[:-2] + (new_h, new_w), x.dtype)
    pad_top, pad_left = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[..., pad_top:pad_top + h, pad_left:pad_left + w] = x
    top, left = top + pad_top, left + pad_left
    return padded[..., max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]


def load_image(source: Any):
    """A Pillow image from a Pillow image, a file path, raw bytes or a data URL (data:image/png;base64,...)."""
    Image = _pil()
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, str) and source.startswith("data:"):
        head, _, payload = source.partition(",")
        if ";base64" not in head:
            raise KvforgeError("an image data URL must be base64 (data:image/png;base64,...)")
        try:
            source = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise KvforgeError(f"an image data URL's payload is not base64: {e}") from e
    elif isinstance(source, str) and source.startswith(("http://", "https://")):
        raise KvforgeError("kvforge does not fetch images from the network: pass a file or a data URL")
    try:
        if isinstance(source, (bytes, bytearray)):
            image = Image.open(io.BytesIO(source))
        else:
            image = Image.open(Path(source))
        image.load()
    except FileNotFoundError as e:
        raise KvforgeError(f"no image at {source}") from e
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        where = "the image bytes" if isinstance(source, (bytes, bytearray)) else str(source)
        raise KvforgeError(f"{where} is not an image Pillow can read: {e}") from e
    return image


def image_prompt_text(style: str, placeholder: str, per_image: int, grid: tuple[int, int] = (0, 0)) -> str:
    """The text that stands for one image in a prompt, as the family's processor writes it (a vision-language
    config's image_prompt): "idefics2" its image tokens between two <fake_token_around_image> (five times over, for
    the four crops and the whole image, where the processing splits it: grid (2, 2)); "idefics3" for a split image
    each tile's <fake_token_around_image><row_r_col_c> and image tokens (a newline after each row), then a newline
    and the whole image's <fake_token_around_image><global-img> image tokens <fake_token_around_image> (that last
    part alone for an unsplit image, grid (0, 0))."""
    fake, tokens = FAKE_IMAGE_TOKEN, placeholder * per_image
    rows, cols = grid
    if style == "idefics2":
        return (fake + tokens + fake) * (rows * cols + 1 if rows else 1)
    if style == "qwen2_vl":  # the placeholder once per image token: the token grid's rows x cols
        return placeholder * (rows * cols)
    if style != "idefics3":
        raise KvforgeError(f"image_prompt {style!r} is not written as text")
    tiles = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{tokens}" for c in range(cols)) + "\n"
                    for r in range(rows))
    return tiles + ("\n" if rows else "") + f"{fake}<global-img>{tokens}{fake}"


def prompt_with_images(style: str, text: str, placeholder: str, per_image: int, grids: list[tuple[int, int]]) -> str:
    """A prompt's text with each placeholder replaced by its image's text (image_prompt_text), as the family's
    processor writes the whole: Idefics2's also joins adjacent images' fake tokens into one and puts a space after a
    closing one that a word follows."""
    pieces = text.split(placeholder)
    out = pieces[0] + "".join(image_prompt_text(style, placeholder, per_image, grid) + piece
                              for grid, piece in zip(grids, pieces[1:]))
    if style == "idefics2":
        out = out.replace(FAKE_IMAGE_TOKEN * 2, FAKE_IMAGE_TOKEN)
        out = re.sub(rf"{re.escape(FAKE_IMAGE_TOKEN)}(?=[^\s<])", f"{FAKE_IMAGE_TOKEN} ", out)
    return out


def rope_offsets(ids: list[int], image_token_id: int, grids: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
    """Multimodal RoPE (Qwen2-VL) for one prompt: ((3, len(ids)) int64, each token's (time, height, width)
    positions less its plain position, its index; the offset of every token after the prompt).

    As transformers' get_rope_index: text runs count up from where the last part ended; an image's rows x cols
    tokens (grids, in order) take time = that start, height = start + row, width = start + col, and the text after
    it starts at start + max(rows, cols). A token after the prompt is at its index + the returned offset."""
    positions = np.zeros((3, len(ids)), np.int64)
    images = iter(grids)
    at = start = 0
    while at < len(ids):
        if ids[at] == image_token_id:
            rows, cols = next(images, (0, 0))
            n = rows * cols
            if n == 0 or at + n > len(ids) or any(t != image_token_id for t in ids[at:at + n]):
                raise KvforgeError(f"the prompt's image tokens at {at} do not make the {rows} x {cols} grid of its image")
            r, c = np.divmod(np.arange(n), cols)
            positions[:, at:at + n] = np.stack([np.full(n, start), start + r, start + c])
            at, start = at + n, start + max(rows, cols)
        else:
            positions[:, at] = start
            at, start = at + 1, start + 1
    offsets = positions - np.arange(len(ids))[None]
    return offsets, int(positions.max(initial=-1) + 1 - len(ids))


def same_size_batches(tiles: list[np.ndarray], limit: int | None = None) -> list[np.ndarray]:
    """pixel_values (3, H, W) of tiles in order -> batches (N, 3, H, W) of consecutive tiles of one size, at most
    `limit` each: what one vision-graph call takes; their outputs concatenated keep the tiles' order."""
    out: list[list[np.ndarray]] = []
    for t in tiles:
        if out and out[-1][0].shape == t.shape and (limit is None or len(out[-1]) < limit):
            out[-1].append(t)
        else:
            out.append([t])
    return [np.stack(group).astype(np.float32, copy=False) for group in out]


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def image_files(directory: str | Path) -> list[Path]:
    """The image files of a directory (PNG, JPEG, WebP, BMP, GIF, TIFF by suffix; not its subdirectories), sorted."""
    directory = Path(directory)
    if not directory.is_dir():
        raise KvforgeError(f"{directory} is not a directory of images")
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise KvforgeError(f"{directory} holds no image files ({', '.join(s[1:] for s in IMAGE_SUFFIXES)})")
    return files


def image_folder(directory: str | Path) -> tuple[list[Path], Path | None]:
    """A folder of images as calibration or comparison data: (its image files, the one .txt or .jsonl file beside
    them that holds the text, or None)."""
    files = image_files(directory)
    texts = sorted(p for p in Path(directory).iterdir() if p.is_file() and p.suffix.lower() in (".txt", ".jsonl"))
    if len(texts) > 1:
        raise KvforgeError(f"{directory} holds {len(texts)} text files ({', '.join(p.name for p in texts)}): the "
                           "decoder's text is one .txt or .jsonl file beside the images")
    return files, (texts[0] if texts else None)


def synthetic_images(count: int, seed: int = 0, size: tuple[int, int] = (320, 256)) -> list[Any]:
    """`count` RGB Pillow images (width, height = size) made from a seed: smooth color fields with a few hard-edged
    shapes and fine texture, so that encoders see both low- and high-frequency content. A stand-in where no
    images were given (calibration, compare); real pictures like the model's inputs calibrate better."""
    Image = _pil()
    from PIL import ImageDraw

    rng = np.random.default_rng(seed)
    width, height = size
    out = []
    for _ in range(count):
        coarse = rng.integers(0, 256, (rng.integers(2, 6), rng.integers(2, 6), 3), dtype=np.uint8)
        image = Image.fromarray(coarse, "RGB").resize((width, height), resample=3)
        draw = ImageDraw.Draw(image)
        for _ in range(int(rng.integers(1, 6))):
            x0, y0 = int(rng.integers(0, width - 8)), int(rng.integers(0, height - 8))
            box = [x0, y0, int(rng.integers(x0 + 4, width)), int(rng.integers(y0 + 4, height))]
            color = tuple(int(c) for c in rng.integers(0, 256, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=color)
        noise = rng.normal(0, rng.uniform(0, 12), (height, width, 3))
        pixels = np.clip(np.asarray(image, np.float64) + noise, 0, 255).astype(np.uint8)
        out.append(Image.fromarray(pixels, "RGB"))
    return out
