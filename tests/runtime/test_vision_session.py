"""Vision-language bundles end to end: a LLaVA made locally with transformers (its image processor too) exported
to vision.onnx + decoder.onnx, run by runtime.load's VisionLanguageSession: greedy generation with images equals
transformers.generate with the processor's pixel_values; a batch of rows with their own images equals each row
alone; `kvforge generate --image` on the llava-micro preset streams what the session generates."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvforge import runtime
from kvforge.cli import main
from kvforge.errors import KvforgeError
from kvforge.export import export

from ..conftest import assert_checked_on_text, make_llava

Image = pytest.importorskip("PIL.Image")
IMAGE_TOKEN, PATCHES = 299, 9


def _image(seed: int, size=(41, 57)):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def _ids(images: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    ids = [1] + rng.integers(3, 290, 4).tolist()
    for _ in range(images):
        ids += [IMAGE_TOKEN] * PATCHES + rng.integers(3, 290, 3).tolist()
    return ids


@pytest.fixture(scope="module")
def llava_bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    hf = make_llava(root / "hf")
    bundle = export(root / "hf", root / "bundle")
    return hf, bundle, root


def test_the_bundle_records_both_graphs_and_the_image_processing(llava_bundle):
    _, bundle, _ = llava_bundle
    assert bundle.kind.name == "vision-language" and bundle.manifest["validation"]["passed"]
    vision = bundle.io.extra["vision"]
    assert bundle.graphs == {"vision": "vision.onnx", "decoder": bundle.manifest["graph"]}
    assert all((bundle.path / name).is_file() for name in bundle.graphs.values())
    assert vision["image_tokens"] == PATCHES and vision["image_token_id"] == IMAGE_TOKEN
    assert bundle.model_config["image_processing"]["crop_size"] == {"height": 30, "width": 30}
    assert_checked_on_text(bundle, "token ids")


@torch.no_grad()
def test_greedy_generation_with_images_is_transformers_generate(llava_bundle):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    hf, bundle, root = llava_bundle
    processor = CLIPImageProcessorPil.from_pretrained(root / "hf")
    images = [_image(1), _image(2, (80, 33))]
    ids = _ids(2, seed=3)
    pixels = torch.from_numpy(processor(images=images, return_tensors="np")["pixel_values"])
    expected = hf.generate(torch.tensor([ids]), pixel_values=pixels, max_new_tokens=10, do_sample=False)[0, len(ids):]
    with runtime.load(bundle.path) as session:
        assert isinstance(session, runtime.VisionLanguageSession)
        got = session.generate(ids, images=images, max_new_tokens=10)
        assert got.tokens == expected.tolist()
        # the images matter (this random model's greedy tokens may not show it; its log-probabilities do)
        swapped = session.generate(ids, images=images[::-1], max_new_tokens=1, logprobs=0).logprobs[0]
        assert abs(swapped - session.generate(ids, images=images, max_new_tokens=1, logprobs=0).logprobs[0]) > 1e-4
        streamed = [e.token for e in session.stream(ids, images=images, max_new_tokens=10)]
        assert streamed == got.tokens


def test_a_batch_of_rows_with_their_own_images_equals_each_row_alone(llava_bundle):
    _, bundle, _ = llava_bundle
    prompts = [_ids(1, seed=4), _ids(2, seed=5) + [7, 8, 9]]
    images = [[_image(6)], [_image(7), _image(8)]]
    with runtime.load(bundle.path) as session:
        together = session.generate(prompts, images=images, max_new_tokens=6, ignore_eos=True)
        alone = [session.generate(p, images=ims, max_new_tokens=6, ignore_eos=True) for p, ims in zip(prompts, images)]
        assert [r.tokens for r in together] == [r.tokens for r in alone]
        with pytest.raises(KvforgeError, match=r"holds 18 image tokens but its 1 image\(s\) take 9"):
            session.generate(prompts[1], images=[_image(9)], max_new_tokens=2)
        with pytest.raises(KvforgeError, match="not an image Pillow can read"):
            session.generate(prompts[0], images=[b"not an image"], max_new_tokens=2)


def test_kvforge_generate_image_streams_what_the_session_generates(tmp_path):
    bundle = export("llava-micro", tmp_path / "b")
    _image(10).save(tmp_path / "a.png")
    prompt = "<image> what is this?"
    with runtime.load(bundle.path) as session:
        expected = session.generate(prompt, images=[tmp_path / "a.png"], max_new_tokens=6, ignore_eos=True).text
        ids = session.encode(prompt)
        assert ids.count(259) == 9 and ids[0] == 256  # one placeholder: 9 image tokens, after the BOS
    result = CliRunner().invoke(main, ["generate", str(bundle.path), "--prompt", prompt, "--image", str(tmp_path / "a.png"),
                                       "--max-new-tokens", "6", "--json"])
    assert result.exit_code == 0, result.output
    import json
    assert json.loads(result.output.strip().splitlines()[-1])["text"] == expected
    refused = CliRunner().invoke(main, ["generate", str(bundle.path), "--prompt", prompt, "--max-new-tokens", "2"])
    assert refused.exit_code == 1 and "holds 9 image tokens" in refused.output


@torch.no_grad()
def test_a_generated_image_token_keeps_its_embedding_as_in_transformers(llava_bundle):
    """A decode step whose token is the image token (a model may generate it) comes with no pixel values: transformers
    embeds it as text; the decoder graph takes no feature row for it and does the same (1e-4)."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    hf, bundle, root = llava_bundle
    image = _image(11)
    ids = _ids(1, seed=12)
    pixels = torch.from_numpy(CLIPImageProcessorPil.from_pretrained(root / "hf")(images=[image], return_tensors="np")
                              ["pixel_values"])
    out = hf(input_ids=torch.tensor([ids]), pixel_values=pixels, use_cache=True)
    want = hf(input_ids=torch.tensor([[IMAGE_TOKEN]]), past_key_values=out.past_key_values).logits[0, -1].numpy()
    with runtime.load(bundle.path) as session:
        logits, cache = session.forward(np.asarray([ids]), session.image_features([image]))
        np.testing.assert_allclose(logits[0, -1], out.logits[0, -1].numpy(), atol=1e-4)
        step, _ = session.forward(np.asarray([[IMAGE_TOKEN]]), None, np.ones((1, len(ids) + 1), np.int64), cache=cache)
        np.testing.assert_allclose(step[0, -1], want, atol=1e-4)
        with pytest.raises(KvforgeError, match="holds 9 image tokens but 0 feature rows"):
            session.forward(np.asarray([ids]), np.zeros((0, 9, bundle.io.input("image_features").shape[-1])))


def test_the_packed_cache_gives_each_call_the_image_rows_of_its_own_tokens(llava_bundle):
    """On the CPU the decoder runs ONNX Runtime's packed-cache variant, which moves a left-padded prefill's real
    tokens to the front and runs a multi-token step over a past at batch 2 as one call per token: each call must get
    the feature rows of the image tokens it holds, in the order it reads them. Its logits equal the exported
    graph's (variant=False: one call over the step as given) to 1e-4; rows given to the wrong calls would not."""
    _, bundle, _ = llava_bundle
    rng = np.random.default_rng(13)
    prefill = np.array([[0, 5, IMAGE_TOKEN, 6], [IMAGE_TOKEN, IMAGE_TOKEN, 7, 8]])
    prefill_mask = np.array([[0, 1, 1, 1], [1, 1, 1, 1]])
    step = np.array([[5, IMAGE_TOKEN, IMAGE_TOKEN, 7], [IMAGE_TOKEN, 8, IMAGE_TOKEN, IMAGE_TOKEN]])
    step_mask = np.concatenate([prefill_mask, np.ones((2, 4), np.int64)], axis=1)
    width = bundle.io.input("image_features").shape[-1]
    first, second = (rng.standard_normal((n, width)).astype(np.float32) for n in (3, 5))
    got = {}
    for variant in (False, True):
        with runtime.load(bundle.path, variant=variant) as session:
            assert session.backend.packed is variant
            a, cache = session.forward(prefill, first, prefill_mask)
            b, _ = session.forward(step, second, step_mask, cache=cache)
            got[variant] = (a[prefill_mask.astype(bool)], b)
    for packed, graph in zip(got[True], got[False]):
        np.testing.assert_allclose(packed, graph, atol=1e-4)
    with runtime.load(bundle.path) as session:  # the features matter to every row of the step
        _, cache = session.forward(prefill, first, prefill_mask)
        swapped, _ = session.forward(step, second[::-1].copy(), step_mask, cache=cache)
        assert (np.abs(swapped - got[True][1]).max(axis=(1, 2)) > 1e-3).all()


def test_the_batcher_runs_image_requests_beside_text_ones_as_each_alone(llava_bundle):
    """Requests with their own images (the same text with different images included), a text-only one, and one
    whose prompt is fed in chunks that split its image tokens, in one continuous batch: each gives what the
    session gives it alone. The prefix cache keys image prompts by their images: the same text with another image
    restores nothing; the same image again restores its blocks."""
    _, bundle, _ = llava_bundle
    shared_text = _ids(1, seed=20)
    jobs = [(shared_text, [_image(21)]), (shared_text, [_image(22)]), (_ids(0, seed=23) + [9] * 12, []),
            (_ids(2, seed=24), [_image(25), _image(26, (30, 90))])]
    with runtime.load(bundle.path) as session:
        alone = [session.generate(ids, images=ims, max_new_tokens=6, ignore_eos=True).tokens for ids, ims in jobs]
        assert alone[0] != alone[1] or session.generate(shared_text, images=jobs[0][1], max_new_tokens=1,
                                                        logprobs=0).logprobs != \
            session.generate(shared_text, images=jobs[1][1], max_new_tokens=1, logprobs=0).logprobs
        with session.batcher(max_batch=4, prefill_chunk=7, prefix_block=4) as batcher:
            requests = [batcher.submit(ids, images=ims, max_new_tokens=6, ignore_eos=True) for ids, ims in jobs]
            got = [r.result(timeout=120).tokens for r in requests]
            assert got == alone
            assert batcher.peak_batch >= 2
        with session.batcher(max_batch=4, prefix_block=4) as batcher:  # one after another: the cache is filled
            first = batcher.submit(jobs[0][0], images=jobs[0][1], max_new_tokens=6, ignore_eos=True)
            assert first.result(timeout=120).tokens == alone[0] and batcher.prefix_stats.hit_tokens == 0
            other = batcher.submit(jobs[1][0], images=jobs[1][1], max_new_tokens=6, ignore_eos=True)
            assert other.result(timeout=120).tokens == alone[1] and batcher.prefix_stats.hit_tokens == 0
            again = batcher.submit(jobs[0][0], images=jobs[0][1], max_new_tokens=6, ignore_eos=True)
            assert again.result(timeout=120).tokens == alone[0]
            assert batcher.prefix_stats.hit_tokens > 0  # the same image's blocks were restored
            with pytest.raises(KvforgeError, match="holds 9 image tokens"):
                batcher.submit(jobs[0][0], max_new_tokens=2)


def test_kvforge_generate_chat_image_puts_the_images_in_the_users_message(tmp_path):
    """`kvforge generate --chat --image` on a bundle with a chat template that writes image parts: the CLI's stream is
    the session's chat of one user message holding the image, then the prompt."""
    import json

    from kvforge.model_defs import load, save_checkpoint
    from kvforge.tokenizer import Tokenizer

    template = ("{% for m in messages %}{{ m['role'] + ': ' }}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
                "{{ '<image>' }}{% else %}{{ p['text'] }}{% endif %}{% endfor %}{{ '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = template
    save_checkpoint(load("llava-micro").model, tmp_path / "ckpt", tokenizer=tokenizer)
    bundle = export(tmp_path / "ckpt", tmp_path / "b")
    _image(30).save(tmp_path / "a.png")
    question = "what is this?"
    with runtime.load(bundle.path) as session:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        ids, images = session.chat_ids(messages, images=[tmp_path / "a.png"])
        assert ids.count(259) == 9 and images == [tmp_path / "a.png"]
        assert session.tokenizer.decode(ids).startswith("user: ")  # the template wrote it, no BOS of the tokenizer's
        expected = session.chat(messages, images=[tmp_path / "a.png"], max_new_tokens=5).text
        with pytest.raises(KvforgeError, match="1 image part.* without their image but 0"):
            session.chat_ids(messages)
    result = CliRunner().invoke(main, ["generate", str(bundle.path), "--chat", "--prompt", question, "--image",
                                       str(tmp_path / "a.png"), "--max-new-tokens", "5", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["text"] == expected
