"""Images over HTTP on a tiny SmolVLM/Idefics3: the openai SDK sending a data URL to chat and to responses,
an http URL fetched from a loopback server, each answered as transformers answers the same image; every
refusal a 400 naming the part (undecodable, too large, too many, a URL that fails or times out, a file
outside --allowed-local-media-path, an image to a text-only model), the server serving on after each."""

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
