// The ladle playground: chat, decisions and live metrics over the server's own API.
// Every URL is relative, so the page also works under --root-path behind a proxy.
"use strict";

const $ = (id) => document.getElementById(id);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// -- the API ----------------------------------------------------------------

const state = { model: null, history: [], decision: null, abort: null, lastMetrics: null };

function headers() {
  const key = localStorage.getItem("ladle.apiKey");
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function post(path, body, signal) {
  const response = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!response.ok) throw new Error(await errorText(response));
  return response;
}

async function loadModel() {
  try {
    const response = await fetch("v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await errorText(response));
    state.model = (await response.json()).data[0].id;
    $("model").textContent = state.model;
    $("model").classList.remove("error");
  } catch (e) {
    state.model = null;
    $("model").textContent = e.message;
    $("model").classList.add("error");
  }
}

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

// -- chat ----------------------------------------------------------------------

function bubble(role, text) {
  const node = el("div", `msg ${role}`, text);
  $("messages").append(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

// Server-sent events: yields the JSON of each `data:` line until [DONE].
async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function sendChat(text) {
  const messages = [...state.history, { role: "user", content: text }];
  bubble("user", text);
  const reply = bubble("assistant", "");
  reply.dataset.state = "streaming";
  const abort = state.abort = new AbortController();
  $("send").textContent = "Stop";
  const body = { model: state.model, messages, stream: true,
                 temperature: numberField("temperature"), max_tokens: numberField("max-tokens") };
  try {
    const response = await post("v1/chat/completions", body, abort.signal);
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      reply.textContent += chunk.choices[0]?.delta?.content ?? "";
      reply.scrollIntoView({ block: "end" });
    }
    state.history = [...messages, { role: "assistant", content: reply.textContent }];
    reply.dataset.state = "done";
  } catch (e) {
    reply.dataset.state = "error";  // a stopped or failed exchange is not kept
    reply.append(el("span", "error", e.name === "AbortError" ? " [stopped]" : ` ${e.message}`));
  } finally {
    if (state.abort === abort) {  // not if Reset already let a newer exchange start
      state.abort = null;
      $("send").textContent = "Send";
    }
  }
}

function resetChat() {
  state.abort?.abort();
  state.abort = null;
  $("send").textContent = "Send";
  state.history = [];
  $("messages").replaceChildren();
}

$("chat-form").addEventListener("submit", (event) => {
  event.preventDefault();
  if (state.abort) return state.abort.abort();
  const text = $("chat-input").value.trim();
  if (!text) return;
  $("chat-input").value = "";
  sendChat(text);
});

$("chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});

$("reset").addEventListener("click", resetChat);

// -- decisions ---------------------------------------------------------------

function parseOptions(text) {
  return text.split("\n").map((line) => line.trim()).filter(Boolean).map((line) => {
    const cut = line.indexOf(" - ");
    return cut < 0 ? { name: line } : { name: line.slice(0, cut).trim(), description: line.slice(cut + 3).trim() };
  });
}

function decisionBody() {
  const question = { id: "decision", type: "choice", question: $("d-question").value,
                     options: parseOptions($("d-options").value) };
  return { model: state.model, input: $("d-input").value, questions: [question],
           temperature: numberField("d-temperature"), return_prompt_token_ids: true };
}

const percent = (p) => `${(100 * p).toFixed(1)}%`;

function drawBars(probabilities, choice) {
  const rows = Object.entries(probabilities).map(([name, p]) => {
    const row = el("div", name === choice ? "bar chosen" : "bar");
    row.dataset.option = name;
    row.dataset.p = String(p);
    const fill = el("i", "fill");
    fill.style.width = `${100 * p}%`;
    const track = el("span", "track");
    track.append(fill);
    row.append(el("span", "name", name), track, el("span", "pct", percent(p)));
    return row;
  });
  $("bars").replaceChildren(...rows);
}

async function runDecision() {
  const body = decisionBody();
  $("decide").disabled = true;
  $("replay-result").replaceChildren();
  try {
    const result = await (await post("v1/decisions", body)).json();
    const answer = result.answers.decision;
    state.decision = { answer, temperature: body.temperature ?? 1 };
    drawBars(answer.probabilities, answer.choice);
    $("d-choice").textContent = answer.choice;
    $("label-mass").textContent = answer.label_mass.toFixed(4);
    $("label-mass").dataset.value = String(answer.label_mass);
    $("d-tokens").textContent = answer.prompt_token_ids.length;
    $("decision-result").hidden = false;
    $("prompt").textContent = "…";
    const rendered = await (await post("detokenize", { model: state.model, tokens: answer.prompt_token_ids })).json();
    $("prompt").textContent = rendered.prompt;
  } catch (e) {
    $("decision-result").hidden = false;
    $("bars").replaceChildren(el("p", "error", e.message));
  } finally {
    $("decide").disabled = false;
  }
}

// The decision's exact prompt tokens and label tokens, scored again: the same numbers, bit for bit.
async function replay() {
  const { answer, temperature } = state.decision;
  const body = { model: state.model, query: answer.prompt_token_ids, label_token_ids: answer.label_token_ids,
                 apply_softmax: true, temperature, return_token_logprobs: true };
  try {
    const result = await (await post("v1/score", body)).json();
    const [scores] = result.scores;
    const [logprobs] = result.token_logprobs;
    const decided = Object.entries(answer.probabilities);
    const match = decided.every(([, p], i) => p === scores[i]);
    const table = el("table");
    table.append(tableRow("th", ["option", "decision", "replayed", "logprob"]));
    const digits = (x) => x.toPrecision(12);  // the verdict compares all the bits
    decided.forEach(([name, p], i) =>
      table.append(tableRow("td", [name, digits(p), digits(scores[i]), logprobs[i].toFixed(4)])));
    const verdict = el("p", match ? "verdict ok" : "verdict bad",
                       match ? "✓ identical to the decision, bit for bit" : "✗ the replay differs from the decision");
    verdict.dataset.match = String(match);
    $("replay-result").replaceChildren(verdict, table);
  } catch (e) {
    $("replay-result").replaceChildren(el("p", "error", e.message));
  }
}

function tableRow(cell, values) {
  const row = el("tr");
  for (const v of values) row.append(el(cell, "", String(v)));
  return row;
}

$("decision-form").addEventListener("submit", (event) => {
  event.preventDefault();
  runDecision();
});
$("replay").addEventListener("click", replay);

// -- metrics -----------------------------------------------------------------

// Prometheus text: the sum of each sample name over its label sets (one model is served).
function parseMetrics(text) {
  const values = {};
  for (const line of text.split("\n")) {
    const m = line.match(/^([A-Za-z_:][\w:]*)(?:\{.*\})?\s+(\S+)/);
    if (m) values[m[1]] = (values[m[1]] ?? 0) + Number(m[2]);
  }
  return values;
}

function showMean(id, values, histogram, unit) {
  const sum = values[`${histogram}_sum`], count = values[`${histogram}_count`];
  const node = $(id);
  if (!count) return;
  node.textContent = `${(1000 * sum / count).toFixed(1)} ms`;
  node.dataset.value = String(sum / count);
  $(`${id}-n`).textContent = `${count} ${unit}${count === 1 ? "" : "s"}`;
}

async function pollMetrics() {
  if (document.hidden) return;
  try {
    const response = await fetch("metrics");
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const values = parseMetrics(await response.text());
    const now = performance.now();
    $("m-running").textContent = values["vllm:num_requests_running"];
    $("m-waiting").textContent = values["vllm:num_requests_waiting"];
    const kv = values["vllm:kv_cache_usage_perc"];
    $("m-kv").textContent = percent(kv);
    $("m-kv-bar").style.width = `${100 * kv}%`;
    showMean("m-ttft", values, "vllm:time_to_first_token_seconds", "request");
    showMean("m-itl", values, "vllm:inter_token_latency_seconds", "token");
    const tokens = values["vllm:generation_tokens_total"], last = state.lastMetrics;
    if (last) $("m-tps").textContent = ((tokens - last.tokens) / ((now - last.time) / 1000)).toFixed(1);
    state.lastMetrics = { tokens, time: now };
    $("m-status").textContent = "";
  } catch (e) {
    $("m-status").textContent = `(${e.message})`;
  }
}

// -- tabs, the API key, start ----------------------------------------------

for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => {
    for (const t of document.querySelectorAll(".tab")) t.classList.toggle("active", t === tab);
    for (const p of document.querySelectorAll("main .panel")) p.classList.toggle("active", p.id === tab.dataset.tab);
  });
}

function saveKey(event) {
  event.preventDefault();
  localStorage.setItem("ladle.apiKey", $("api-key").value.trim());
  loadModel();
}

$("api-key").value = localStorage.getItem("ladle.apiKey") ?? "";
$("api-key").addEventListener("change", saveKey);
$("key-form").addEventListener("submit", saveKey);

loadModel();
pollMetrics();
setInterval(pollMetrics, 2000);
