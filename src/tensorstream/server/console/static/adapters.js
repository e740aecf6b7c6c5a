// Adapters: the loaded ones (from /v1/models), load from an allowed location, unload;
// all through the public API, showing the server's own answer (refusals included).

import { APIError, AuthRequired, postText } from "./api.js";
import { el } from "./format.js";

export class AdaptersPanel {
  constructor({ list, form, name, path, keyfile, load, message, policy }, onChange) {
    Object.assign(this, { list, form, name, path, keyfile, load, message, policy });
    this.onChange = onChange;
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.loadAdapter();
    });
  }

  /** Describe what the operator allows (from /v1/load_stats' `server`). */
  setPolicy(server) {
    if (!server) return;
    if (!server.lora_enabled) {
      this.policy.textContent = "LoRA is off (the server was started without --enable-lora).";
    } else if (!server.runtime_lora_updating) {
      this.policy.textContent = "Loading over HTTP is off (--enable-runtime-lora-updating); the server will refuse loads.";
    } else if (!server.lora_allowed_roots.length) {
      this.policy.textContent = "Loading over HTTP is on, but no location is allowed (--lora-allowed-roots).";
    } else {
      this.policy.textContent = `Loads allowed from: ${server.lora_allowed_roots.join(", ")}`;
      if (!this.path.placeholder) this.path.placeholder = `${server.lora_allowed_roots[0]}/…`;
    }
  }

  /** Show the adapters among `/v1/models` entries. */
  show(models) {
    const adapters = models.filter((m) => m.parent);
    const key = JSON.stringify(adapters.map((a) => [a.id, a.root]));
    if (key === this.shown) return; // unchanged: keep keyboard focus where it is
    this.shown = key;
    if (!adapters.length) {
      this.list.replaceChildren(el("tr", {}, el("td", { colspan: 3, class: "hint" }, "No adapter loaded.")));
      return;
    }
    this.list.replaceChildren(
      ...adapters.map((a) => {
        const button = el("button", { type: "button", class: "quiet", "aria-label": `Unload ${a.id}` }, "Unload");
        button.addEventListener("click", () => this.unload(a.id, button));
        return el("tr", { "data-adapter": a.id }, el("th", { scope: "row" }, a.id), el("td", { class: "path" }, a.root), el("td", {}, button));
      }),
    );
  }

  say(text, failed) {
    this.message.textContent = text;
    this.message.classList.toggle("error", Boolean(failed));
    this.message.dataset.state = failed ? "error" : "ok";
  }

  async loadAdapter() {
    const body = { lora_name: this.name.value.trim(), lora_path: this.path.value.trim() };
    if (this.keyfile.value.trim()) body.encryption_keyfile = this.keyfile.value.trim();
    this.load.disabled = true;
    this.say(`Loading ${body.lora_name}…`, false);
    try {
      this.say(await postText("/v1/load_lora_adapter", body), false);
      this.name.value = "";
      this.keyfile.value = "";
      await this.onChange();
    } catch (err) {
      this.fail(err);
    } finally {
      this.load.disabled = false;
    }
  }

  async unload(name, button) {
    button.disabled = true;
    this.say(`Unloading ${name}…`, false);
    try {
      this.say(await postText("/v1/unload_lora_adapter", { lora_name: name }), false);
      await this.onChange();
    } catch (err) {
      button.disabled = false;
      this.fail(err);
    }
  }

  fail(err) {
    if (err instanceof AuthRequired) this.say("The API key is needed.", true);
    else if (err instanceof APIError) this.say(`Refused (${err.status}): ${err.message}`, true);
    else this.say(`Failed: ${err.message}`, true);
  }
}
