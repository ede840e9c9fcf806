// The playground: chat or completion requests streamed from the server's own OpenAI endpoints,
// with the usual sampling controls; tokens are shaded by probability when logprobs are on.

import { apiFetch, errorText, sseData } from "./api.js";

const $ = (id) => document.getElementById(id);

export class Playground {
  constructor() {
    this.mode = "chat";
    this.messages = []; // the chat so far (user and assistant turns; the system prompt is added per request)
    this.controllers = [];
    this.model = null;
    document.querySelectorAll(".tab").forEach((tab) => tab.addEventListener("click", () => this.setMode(tab.dataset.mode)));
    $("send").addEventListener("click", () => this.send());
    $("stop-button").addEventListener("click", () => this.stop());
    $("clear").addEventListener("click", () => this.clear());
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) this.send();
    });
  }

  setMode(mode) {
    this.mode = mode;
    document.querySelectorAll(".tab").forEach((tab) => tab.classList.toggle("active", tab.dataset.mode === mode));
    $("playground").dataset.mode = mode;
    $("prompt-label").textContent = mode === "chat" ? "Message" : "Prompt";
  }

  clear() {
    this.messages = [];
    $("conversation").innerHTML = "";
    $("output").innerHTML = "";
    $("output").dataset.state = "idle";
    $("output").dataset.chars = "0";
  }

  stop() {
    this.controllers.forEach((c) => c.abort());
  }

  async modelName() {
    if (this.model) return this.model;
    const response = await apiFetch("/v1/models");
    if (!response.ok) throw new Error(await errorText(response));
    this.model = (await response.json()).data[0].id;
    return this.model;
  }

  params() {
    const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
    const body = {
      temperature: number("temperature"), top_p: number("top_p"), top_k: number("top_k"),
      max_tokens: number("max_tokens"), seed: number("seed"), n: number("n"), stream: true,
    };
    const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
    if (stop.length) body.stop = stop;
    if ($("ignore_eos").checked) body.ignore_eos = true;
    if ($("logprobs").checked) {
      if (this.mode === "chat") Object.assign(body, { logprobs: true, top_logprobs: 3 });
      else body.logprobs = 3;
    }
    Object.keys(body).forEach((k) => body[k] === undefined && delete body[k]);
    return body;
  }

  async send() {
    const text = $("prompt").value;
    if (!text.trim() || this.controllers.length) return;
    const output = $("output");
    output.innerHTML = "";
    output.dataset.chars = "0";
    output.dataset.state = "streaming";
    $("send").disabled = true;
    $("stop-button").disabled = false;
    const copies = Math.max(1, Math.min(16, Number($("copies").value) || 1));
    let body;
    try {
      body = { model: await this.modelName(), ...this.params() };
    } catch (error) {
      return this.finish(`error: ${error.message}`, "error");
    }
    let path;
    if (this.mode === "chat") {
      this.messages.push({ role: "user", content: text });
      this.addTurn("user", text);
      const system = $("system").value.trim();
      body.messages = [...(system ? [{ role: "system", content: system }] : []), ...this.messages];
      path = "/v1/chat/completions";
    } else {
      body.prompt = text;
      path = "/v1/completions";
    }
    $("prompt").value = this.mode === "chat" ? "" : text;
    const started = performance.now();
    const results = await Promise.all(Array.from({ length: copies }, (_, copy) => this.stream(path, body, copy, copies)));
    const failed = results.find((r) => r.error);
    if (this.mode === "chat" && !failed) {
      const reply = results[0].texts[0] || "";
      this.messages.push({ role: "assistant", content: reply });
      this.addTurn("assistant", reply);
    } else if (this.mode === "chat") {
      this.messages.pop();
    }
    const seconds = ((performance.now() - started) / 1000).toFixed(1);
    this.finish(failed ? `error: ${failed.error}` : `${copies} request(s) in ${seconds} s`, failed ? "error" : "done");
  }

  finish(info, state) {
    $("send-info").textContent = info;
    $("output").dataset.state = state;
    $("send").disabled = false;
    $("stop-button").disabled = true;
    this.controllers = [];
  }

  addTurn(role, text) {
    const turn = document.createElement("div");
    turn.className = `turn ${role}`;
    turn.textContent = text;
    $("conversation").appendChild(turn);
    $("conversation").scrollTop = $("conversation").scrollHeight;
  }

  // One streamed request; returns {texts: [per choice], error}.
  async stream(path, body, copy, copies) {
    const controller = new AbortController();
    this.controllers.push(controller);
    const texts = [];
    const boxes = [];
    const box = (index) => {
      if (!boxes[index]) {
        const div = document.createElement("div");
        div.className = "choice";
        div.innerHTML = `<div class="choice-head">${copies > 1 ? `copy ${copy + 1} · ` : ""}choice ${index}</div><div class="tokens"></div>`;
        $("output").appendChild(div);
        boxes[index] = div.lastChild;
        texts[index] = "";
      }
      return boxes[index];
    };
    try {
      const response = await apiFetch(path, {
        method: "POST", body: JSON.stringify(body), signal: controller.signal,
        headers: { "Content-Type": "application/json" },
      });
      if (!response.ok) return { texts, error: await errorText(response) };
      for await (const data of sseData(response)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) return { texts, error: chunk.error.message };
        for (const choice of chunk.choices || []) {
          const target = box(choice.index);
          const text = this.mode === "chat" ? (choice.delta && choice.delta.content) || "" : choice.text || "";
          texts[choice.index] += text;
          this.render(target, text, choice.logprobs);
          const out = $("output");
          out.dataset.chars = String(Number(out.dataset.chars) + text.length);
        }
      }
      return { texts, error: null };
    } catch (error) {
      return { texts, error: error.name === "AbortError" ? null : error.message };
    }
  }

  // Append text; with logprobs, one span per token shaded red (unlikely) to green (likely).
  render(target, text, logprobs) {
    const tokens = tokenLogprobs(logprobs);
    if (!tokens.length) {
      target.appendChild(document.createTextNode(text));
      return;
    }
    for (const t of tokens) {
      const p = Math.exp(t.logprob);
      const span = document.createElement("span");
      span.className = "tok";
      span.textContent = t.token;
      span.style.background = `hsla(${(p * 120).toFixed(0)}, 75%, 45%, 0.45)`;
      span.title = `p=${p.toFixed(3)} (logprob ${t.logprob.toFixed(3)})` +
        (t.top.length ? "\n" + t.top.map(([tok, lp]) => `${JSON.stringify(tok)}: ${Math.exp(lp).toFixed(3)}`).join("\n") : "");
      target.appendChild(span);
    }
  }
}

// Chat ({content: [{token, logprob, top_logprobs}]}) and completion ({tokens, token_logprobs,
// top_logprobs}) logprobs as [{token, logprob, top: [[token, logprob]]}].
function tokenLogprobs(logprobs) {
  if (!logprobs) return [];
  if (logprobs.content) {
    return logprobs.content.map((c) => ({
      token: c.token, logprob: c.logprob, top: (c.top_logprobs || []).map((t) => [t.token, t.logprob]),
    }));
  }
  return (logprobs.tokens || []).map((token, i) => ({
    token, logprob: logprobs.token_logprobs[i] ?? 0, top: Object.entries((logprobs.top_logprobs || [])[i] || {}),
  }));
}
