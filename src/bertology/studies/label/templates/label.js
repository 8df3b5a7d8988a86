// bertology labelling page: one map at a time, keys 1-5 label it, every label is POSTed and saved at once. No innerHTML.
(function () {
  "use strict";
  const state = { maps: [], classes: [], position: 0, ready: false };
  window.bertologyLabel = state;
  const canvas = document.getElementById("map"), context = canvas.getContext("2d");

  function decode(text) {
    const binary = atob(text), bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
    return bytes;
  }
  function labelled() { return state.maps.filter(function (m) { return m.label; }).length; }
  function firstOpen(from) {
    for (let k = 0; k < state.maps.length; k++) { const p = (from + k) % state.maps.length; if (!state.maps[p].label) return p; }
    return -1;
  }

  function draw() {
    const item = state.maps[state.position], n = item.n, weights = item.weights;
    const cell = Math.max(2, Math.min(18, Math.floor(560 / n))), margin = n <= 64 ? 90 : 10;
    const ratio = window.devicePixelRatio || 1, size = margin + n * cell;
    canvas.width = size * ratio; canvas.height = size * ratio;
    canvas.style.width = size + "px"; canvas.style.height = size + "px";
    context.setTransform(ratio, 0, 0, ratio, 0, 0);
    context.fillStyle = "#fff"; context.fillRect(0, 0, size, size);
    for (let i = 0; i < n; i++) {
      for (let j = 0; j < n; j++) {
        const v = 255 - Math.round(255 * Math.sqrt(weights[i * n + j] / 255));
        context.fillStyle = "rgb(" + v + "," + v + ",255)";
        context.fillRect(margin + j * cell, margin + i * cell, cell, cell);
      }
    }
    if (margin > 10) {  // token names: queries down the left, keys along the top
      context.fillStyle = "#1d2330"; context.font = Math.min(12, cell) + "px ui-monospace, monospace"; context.textBaseline = "middle";
      for (let i = 0; i < n; i++) {
        const name = item.tokens[i].length > 12 ? item.tokens[i].slice(0, 11) + "\u2026" : item.tokens[i];
        context.textAlign = "right"; context.fillText(name, margin - 4, margin + i * cell + cell / 2);
        context.save(); context.translate(margin + i * cell + cell / 2, margin - 4); context.rotate(-Math.PI / 2);
        context.textAlign = "left"; context.fillText(name, 0, 0); context.restore();
      }
    }
    document.getElementById("position").textContent = (state.position + 1) + " of " + state.maps.length;
    document.getElementById("where").textContent = "layer " + item.layer + ", head " + item.head + " (from 0)";
    document.getElementById("text").textContent = item.text + (item.text_pair ? "  ||  " + item.text_pair : "");
    document.getElementById("progress").textContent = labelled() + " of " + state.maps.length + " labelled";
    document.querySelectorAll("#classes button").forEach(function (button) { button.classList.toggle("chosen", button.dataset.label === item.label); });
    document.getElementById("done").textContent = firstOpen(0) < 0 ? "All " + state.maps.length + " maps are labelled: the file is ready for bertology patterns --train." : "";
  }

  function go(position) { state.position = (position + state.maps.length) % state.maps.length; draw(); }

  function choose(label) {
    const position = state.position, item = state.maps[position];
    return fetch("/label", { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ position: position, label: label }) })
      .then(function (response) { if (!response.ok) throw new Error("the label was not saved (" + response.status + ")"); return response.json(); })
      .then(function () {
        item.label = label;
        const next = firstOpen(position + 1);
        go(next < 0 ? position : next);
      })
      .catch(function (error) { document.getElementById("done").textContent = String(error); });
  }

  document.addEventListener("keydown", function (event) {
    if (!state.ready) return;
    const k = Number(event.key);
    if (k >= 1 && k <= state.classes.length) { event.preventDefault(); choose(state.classes[k - 1]); }
    else if (event.key === "ArrowLeft" || event.key === "Backspace") { event.preventDefault(); go(state.position - 1); }
    else if (event.key === "ArrowRight" || event.key === "s") { event.preventDefault(); go(state.position + 1); }
  });
  document.getElementById("back").addEventListener("click", function () { go(state.position - 1); });
  document.getElementById("skip").addEventListener("click", function () { go(state.position + 1); });

  fetch("/queue").then(function (response) { return response.json(); }).then(function (queue) {
    state.classes = queue.classes;
    state.maps = queue.maps.map(function (m) { return Object.assign(m, { weights: decode(m.weights) }); });
    document.getElementById("model").textContent = queue.model;
    document.getElementById("file").textContent = queue.file;
    const box = document.getElementById("classes");
    queue.classes.forEach(function (label, k) {
      const button = document.createElement("button");
      button.dataset.label = label;
      const key = document.createElement("kbd"); key.textContent = String(k + 1);
      button.append(key, document.createTextNode(label));
      button.addEventListener("click", function () { choose(label); });
      box.appendChild(button);
    });
    const open = firstOpen(0);
    go(open < 0 ? 0 : open);
    state.ready = true;
    document.body.dataset.ready = "1";
  });
})();
