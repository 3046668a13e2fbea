"""Images over HTTP on a tiny SmolVLM/Idefics3: the openai SDK sending a data URL to chat, to responses and
to decisions, an http URL fetched from a loopback server, each answered as transformers answers the same
image; several decision questions about one image encode it once; every refusal a 400 naming the part
(undecodable, too large, too many, a URL that fails or times out, a file outside
--allowed-local-media-path, an image to a text-only model), the server serving on after each."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from ladle.config import EngineConfig
from ladle.server.media import MediaLimits
from server_utils import MODEL, own_server
from tiny_vlm import build_tiny_idefics3, drawn_image

MAX_BYTES = 20_000  # the drawings are a few hundred bytes; a 200 x 200 noise PNG is far over
QUESTION = "What is drawn here?"


def png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class Images(http.server.BaseHTTPRequestHandler):
    """/ok.png: a drawing; /slow.png: the drawing after 3 s; anything else: 404."""

    def do_GET(self) -> None:  # noqa: N802
        if self.path not in ("/ok.png", "/slow.png"):
            self.send_error(404)
            return
        if self.path == "/slow.png":
            time.sleep(3)
        body = png(drawn_image(1))
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except BrokenPipeError:  # the server gave up waiting (the timeout case)
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{host.server_port}"
    host.shutdown()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny_idefics3(tmp_path_factory.mktemp("idefics3"), smollm2_dir)


@pytest.fixture(scope="module")
def vlm(folder: Path, tmp_path_factory: pytest.TempPathFactory):
    local = tmp_path_factory.mktemp("media")
    (local / "ok.png").write_bytes(png(drawn_image(1)))
    config = EngineConfig(model=str(folder), dtype="float32", kv_cache_memory_gib=0.05,
                          limit_mm_per_prompt={"image": 2})
    media = MediaLimits(max_bytes=MAX_BYTES, fetch_timeout_s=1.0, allowed_local_media_path=str(local))
    with own_server(config, media=media) as server:
        yield server, openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0), local


@pytest.fixture(scope="module")
def expected(folder: Path) -> str:
    """transformers' greedy reply (4 tokens) to QUESTION about drawn_image(1), through SmolVLM's template."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    model = Idefics3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(str(folder))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[drawn_image(1)], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False, eos_token_id=2, pad_token_id=0)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def chat(client: openai.OpenAI, *urls: str, text: str = QUESTION) -> str:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls] + [{"type": "text", "text": text}]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                           max_tokens=4, temperature=0)
    return reply.choices[0].message.content


def test_chat_and_responses_take_a_data_url_as_transformers_answers(vlm, expected: str) -> None:
    server, client, _ = vlm
    url = data_url(png(drawn_image(1)))
    assert chat(client, url) == expected
    reply = client.responses.create(model=MODEL, max_output_tokens=4, temperature=0,
                                    input=[{"role": "user", "content": [{"type": "input_image", "image_url": url},
                                                                        {"type": "input_text", "text": QUESTION}]}])
    assert reply.output_text == expected


def test_an_http_url_and_a_local_file_are_fetched(vlm, expected: str, image_host: str) -> None:
    server, client, local = vlm
    assert chat(client, f"{image_host}/ok.png") == expected
    assert chat(client, (local / "ok.png").as_uri()) == expected


def test_metrics_count_images_encoder_runs_and_cache_hits(vlm) -> None:
    server, client, _ = vlm
    before = server.scrape()
    url = data_url(png(drawn_image(9)))
    chat(client, url)
    chat(client, url, text="And now?")
    after = server.scrape()
    change = {name: after[f"ladle:{name}_total"] - before[f"ladle:{name}_total"]
              for name in ("images_received", "image_encoder_runs", "image_encoder_cache_hits")}
    assert change == {"images_received": 2, "image_encoder_runs": 1, "image_encoder_cache_hits": 1}
    assert after["ladle:image_encoder_seconds_total"] > before["ladle:image_encoder_seconds_total"]


REFUSALS = {
    "undecodable": (lambda host: [data_url(b"not an image")], "messages[0].content[0].image_url"),
    "too large": (lambda host: [data_url(png(__import__("PIL.Image").Image.effect_noise((200, 200), 90)))],
                  "messages[0].content[0].image_url"),
    "too many": (lambda host: [data_url(png(drawn_image(i))) for i in range(3)], "messages[0].content[2].image_url"),
    "a URL that fails": (lambda host: [f"{host}/missing.png"], "messages[0].content[0].image_url"),
    "a URL that times out": (lambda host: [f"{host}/slow.png"], "messages[0].content[0].image_url"),
    "a file outside the allowed path": (lambda host: ["file:///etc/hostname"], "messages[0].content[0].image_url"),
    "not a URL": (lambda host: ["ftp://example.com/a.png"], "messages[0].content[0].image_url"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_each_refusal_names_the_part_and_the_server_serves_on(vlm, image_host: str, case: str) -> None:
    server, client, _ = vlm
    urls, param = REFUSALS[case]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, *urls(image_host))
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert chat(client, data_url(png(drawn_image(2))))  # still serving


QUESTIONS = [
    {"type": "choice", "instructions": "What is the main colour?",
     "choices": [{"value": "red"}, {"value": "green"}, {"value": "blue"}]},
    {"type": "predicate", "instructions": "There is a circle."},
    {"type": "score", "instructions": "How busy is the picture?", "levels": [{"label": "empty"}, {"label": "some"},
                                                                            {"label": "crowded"}]},
    {"type": "predicate", "instructions": "The parcel is damaged."},
]


def hf_label_probabilities(folder: Path, image, text: str, question: dict) -> list[float]:
    """transformers' label probabilities for one decision question about an image: the prompt rendered in
    ladle's decision format (its marker where the image goes), then the processor and one forward."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    from ladle.decisions.labels import LabelChecker, base_labels
    from ladle.decisions.openai_dialect import OpenAIDecisionRequest, to_questions
    from ladle.decisions.render import question_message, render_prompt, template_kwargs
    from ladle.model.tokenizer import Tokenizer

    [q] = to_questions(OpenAIDecisionRequest(model=MODEL, input="x", questions=[question]))
    tok, labels = Tokenizer.from_folder(folder), base_labels(q)
    prompt = render_prompt(tok, question_message(text, q, labels), template_kwargs(None), q, "<image>")
    processor = AutoProcessor.from_pretrained(str(folder))
    model = Idefics3ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    inputs = processor(text=prompt, images=[image], return_tensors="pt")
    label_ids = LabelChecker(tok).check(q, prompt, inputs["input_ids"][0].tolist(), labels)
    with torch.no_grad():
        logits = model(**inputs).logits[0, -1]
    return torch.softmax(torch.log_softmax(logits.double(), -1)[label_ids], -1).tolist()


def test_decisions_about_an_image_match_transformers_and_encode_it_once(vlm, folder: Path) -> None:
    server, client, _ = vlm
    image = drawn_image(11)
    content = [{"type": "input_image", "image_url": data_url(png(image))}, {"type": "input_text", "text": "A photo."}]
    before = server.scrape()
    d = client.decisions.create(model=MODEL, input=[{"role": "user", "content": content}], questions=QUESTIONS)
    after = server.scrape()
    assert after["ladle:image_encoder_runs_total"] - before["ladle:image_encoder_runs_total"] == 1
    assert after["ladle:images_received_total"] - before["ladle:images_received_total"] == len(QUESTIONS)
    assert d.usage.input_tokens_details.cached_tokens >= 3 * 80  # the others start on the first's image blocks
    choice = [p.probability for p in d.answers[0].probabilities]
    want = hf_label_probabilities(folder, image, "<image>\nA photo.", QUESTIONS[0])
    assert choice == pytest.approx(want, abs=1e-4)
    assert d.answers[1].probability == pytest.approx(hf_label_probabilities(folder, image, "<image>\nA photo.",
                                                                            QUESTIONS[1])[0], abs=1e-4)
    again = client.decisions.create(model=MODEL, input=[{"role": "user", "content": content}], questions=QUESTIONS)
    assert [p.probability for p in again.answers[0].probabilities] == choice  # canonical: the same bits cached
    other = [{"type": "input_image", "image_url": data_url(png(drawn_image(12)))}, content[1]]
    miss = client.decisions.create(model=MODEL, input=[{"role": "user", "content": other}], questions=QUESTIONS[:1])
    assert [p.probability for p in miss.answers[0].probabilities] != choice


def test_an_image_in_question_instructions_is_refused_by_name(vlm) -> None:
    server, client, _ = vlm
    question = {"type": "predicate", "instructions": [{"type": "input_image", "image_url": data_url(b"x")}]}
    with pytest.raises(openai.BadRequestError) as e:
        client.decisions.create(model=MODEL, input="A photo.", questions=[question])
    assert e.value.body["param"] == "questions[0].instructions[0]", e.value.body


def test_responses_refusals_name_the_input_part(vlm) -> None:
    server, client, _ = vlm
    content = [{"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": data_url(b"junk")}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, max_output_tokens=2, instructions="Be brief.",
                                input=[{"role": "user", "content": "Hi"}, {"role": "user", "content": content}])
    assert e.value.body["param"] == "input[1].content[1].image_url", e.value.body


def test_an_image_to_a_text_only_model_is_a_400_naming_it(server) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, data_url(png(drawn_image(1))))
    assert e.value.body["param"] == "messages[0].content[0].image_url"
    assert "text-only" in e.value.body["message"]
    assert httpx.get(f"{server.base_url}/models").status_code == 200


def test_a_prefill_worker_hands_an_image_prompt_over_keyed_by_the_image(folder: Path, expected: str) -> None:
    """Disaggregated prefill/decode: the decode worker continues from the K/V of the image prompt, and enters
    its blocks into its prefix cache under the image's hash (another image with the same text misses)."""
    def config(role: str) -> EngineConfig:
        return EngineConfig(model=str(folder), dtype="float32", kv_cache_memory_gib=0.05,
                            kv_transfer_config={"kv_role": role, "kv_port": 0})

    def ask(server, image, **extra) -> dict:
        content = [{"type": "image_url", "image_url": {"url": data_url(png(image))}}, {"type": "text", "text": QUESTION}]
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 4,
                **extra}
        r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    with own_server(config("kv_producer")) as producer, own_server(config("kv_consumer")) as consumer:
        params = ask(producer, drawn_image(1), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        got = ask(consumer, drawn_image(1), kv_transfer_params=params["kv_transfer_params"])
        assert got["choices"][0]["message"]["content"] == expected
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == got["usage"]["prompt_tokens"]
        other = ask(consumer, drawn_image(2))
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < 16
