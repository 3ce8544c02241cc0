/* The Scale page's calculator (reading_notes/scale.md.j2, study.scale_calculator).

   The page hands the calculator's element a grid of closed forms as its `scaleGrid`
   (reading_notes/traces/layout_grid.json, written by `python -m reference.measure.scale.grid` from
   reference.measure.scale.formulas). This script computes no formula: it looks the chosen layout up in the
   grid's three tables, adds up a stage's rows per group and its held bytes, and writes them with units. At CP > 1
   it shows instead the grid's "cp" entry: one layer's ring-attention rows on a cp rank and their totals over the
   stage, as `--cp N` prints them, with the attention activations the same layout saves at CP 1 beside them.
   reference.measure.scale.grid.lookup and cp_lookup read the grid the same way (tests/reference/test_scale_grid.py);
   tests/site/test_browser.py sets the controls in Chromium and reads what is shown. Self-contained, no network;
   it runs once per page load, or on each page material's instant navigation swaps in (its `document$`). */
(function () {
  "use strict";

  const UNITS = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  const GROUPS = [["tp", "TP"], ["pp", "PP"], ["dp", "DP"]];
  const HELD = {
    parameters: "parameters",
    gradients: "gradients",
    master_weights: "fp32 master weights",
    optimizer_states: "Adam moments",
  };

  /* Bytes as reference.measure.scale.formulas.human prints them: 2 decimals of the largest binary unit,
     thousands separated. Python rounds a tie to the even digit where toFixed rounds it up, so the rounding
     is done here on integers (exact: nbytes * 100 stays below 2^53 and the unit is a power of two). */
  function human(nbytes) {
    for (const [unit, size] of UNITS) {
      if (nbytes >= size) {
        let hundredths = Math.floor((nbytes * 100) / size);
        const twiceRest = 2 * (nbytes * 100 - hundredths * size);
        if (twiceRest > size || (twiceRest === size && hundredths % 2 === 1)) hundredths += 1;
        const whole = Math.floor(hundredths / 100).toLocaleString("en-US");
        return `${whole}.${String(hundredths % 100).padStart(2, "0")} ${unit}`;
      }
    }
    return `${nbytes} B`;
  }

  function key(table, setting) {
    return table.by.map((name) => setting[name]).join("/");
  }

  /* At CP > 1: the CLI's refusal (a string) of a switch the CP rows leave out or of the setup, or
     {rows: [[what, count, bytes, formula]], stage_layers, ring_bytes_per_layer, ring_bytes_per_stage,
     saved_bytes_per_stage}. */
  function cpLookup(grid, setting) {
    for (const [sw, refusal] of Object.entries(grid.cp.refusals)) {
      if (setting[sw] === "1") return refusal;
    }
    return grid.cp.entries[key(grid.cp, setting)];
  }

  /* The reference's refusal (a string), or {stages: [{stage, rank, held, rows}], bubble}: the rows of the
     traffic table (TP, PP) and of the state table (DP) of the same stage, in the CLI's order. */
  function lookup(grid, setting) {
    if (setting.model in grid.cp.dense_refusals) return grid.cp.dense_refusals[setting.model];
    const traffic = grid.traffic.entries[key(grid.traffic, setting)];
    const state = grid.state.entries[key(grid.state, setting)];
    if (typeof traffic === "string") return traffic;
    if (typeof state === "string") return state;
    const stages = state.map((held, i) => ({
      stage: held.stage,
      rank: held.rank,
      held: Object.fromEntries(grid.held.map((what, j) => [what, held.held[j]])),
      rows: traffic[i].rows.concat(held.rows),
    }));
    return { stages, bubble: grid.bubble.entries[key(grid.bubble, setting)] };
  }

  /* An element with attributes and children (strings become text: nothing from the grid is parsed as HTML). */
  function el(tag, attributes, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes || {})) node.setAttribute(name, value);
    node.append(...children);
    return node;
  }

  function stageName(stage, stages) {
    if (stages === 1) return "stage 0 (only)";
    return `stage ${stage} (${stage === 0 ? "first" : stage === stages - 1 ? "last" : "middle"})`;
  }

  /* A table cell of bytes: the unit for reading, the exact count on hover, a line of detail under it. */
  function bytesCell(stage, row, nbytes, detail) {
    const exact = `${nbytes.toLocaleString("en-US")} bytes`;
    const cell = el("td", { "data-stage": stage, "data-row": row });
    cell.append(el("span", { class: "scale-calculator__bytes", title: exact }, human(nbytes)));
    if (detail) cell.append(el("br"), el("small", {}, detail));
    return cell;
  }

  function setting(form) {
    const chosen = {};
    for (const field of form.elements) {
      chosen[field.name] = field.type === "checkbox" ? (field.checked ? "1" : "0") : field.value;
    }
    return chosen;
  }

  function command(form) {
    const words = [".venv/bin/python -m reference.measure.scale"];
    for (const field of form.elements) {
      if (field.name === "cp" && field.value === "1") continue; // the CLI's default, named only when used
      if (field.type !== "checkbox") words.push(`${field.dataset.flag} ${field.value}`);
      else if (field.checked) words.push(field.dataset.flag);
    }
    return words;
  }

  /* The command's words, each kept on one line (a flag is not split at its hyphens), wrapped between them. */
  function commandLine(words) {
    const code = el("code", {});
    words.forEach((word, i) => code.append(...(i ? [" "] : []), el("span", {}, word)));
    return code;
  }

  function summary(chosen, bubble) {
    const ranks = Number(chosen.tp) * Number(chosen.pp) * Number(chosen.dp);
    const world = `${ranks.toLocaleString("en-US")} ${ranks === 1 ? "GPU" : "GPUs"}`;
    const percent = `${(100 * bubble).toFixed(1)} %`;
    return el(
      "p",
      {},
      `${chosen.model} on TP ${chosen.tp} × PP ${chosen.pp} × DP ${chosen.dp} = ${world}, `,
      `m = ${chosen.microbatches} micro-batches per step. Pipeline bubble (p − 1)/(m + p − 1): `,
      el("strong", { class: "scale-calculator__bubble", "data-value": bubble }, percent),
      " of the step's time.",
    );
  }

  /* One column per traced stage: the bytes it holds, then the bytes per step of each group's collectives. */
  function table(stages, p) {
    const heading = (text) => el("tr", {}, el("th", { colspan: stages.length + 1 }, text));
    const head = el("tr", {}, el("th", {}, ""));
    for (const s of stages) head.append(el("th", {}, `${stageName(s.stage, p)}, rank ${s.rank}`));
    const body = el("tbody", {}, heading("Held per GPU (no activations)"));
    for (const [what, label] of Object.entries(HELD)) {
      body.append(el("tr", {}, el("th", {}, label), ...stages.map((s) => bytesCell(s.stage, what, s.held[what]))));
    }
    const totals = stages.map((s) => bytesCell(s.stage, "total", Object.values(s.held).reduce((a, b) => a + b, 0)));
    body.append(el("tr", { class: "scale-calculator__total" }, el("th", {}, "total"), ...totals));
    // the recorder's bytes (an all-gather's output, a reduce-scatter's input), not what ring algorithms send
    body.append(heading("Tensor bytes in the collectives per step, by process group (not the bytes a ring sends)"));
    for (const [group, label] of GROUPS) {
      const cells = stages.map((s) => {
        const rows = s.rows.filter((r) => r[0] === group); // [group, op, count, bytes]
        if (rows.length === 0) return el("td", { "data-stage": s.stage, "data-row": group }, "—");
        const kinds = rows.map((r) => `${r[2]} × ${r[1]}`).join(", ");
        return bytesCell(s.stage, group, rows.reduce((sum, r) => sum + r[3], 0), kinds);
      });
      body.append(el("tr", {}, el("th", {}, label), ...cells));
    }
    const grid = el("table", { class: "scale-calculator__table" }, el("thead", {}, head), body);
    return el("div", { class: "scale-calculator__scroll" }, grid);
  }

  /* One cp rank's ring attention: a row per closed form of one layer, then the stage's totals. */
  function cpTable(found, atOne) {
    const head = el("tr", {}, ...["", "count", "bytes", "closed form"].map((text) => el("th", {}, text)));
    const body = el("tbody", {});
    for (const [what, count, nbytes, formula] of found.rows) {
      const cells = [el("td", {}, String(count)), bytesCell("cp", what, nbytes), el("td", {}, formula)];
      body.append(el("tr", {}, el("th", {}, what), ...cells));
    }
    const layers = found.stage_layers;
    const perLayer = `${human(found.ring_bytes_per_layer)} a layer`;
    body.append(
      el(
        "tr",
        { class: "scale-calculator__total" },
        el("th", {}, `ring sends, the stage's ${layers} layers`),
        el("td", {}, ""),
        bytesCell("cp", "ring_bytes_per_stage", found.ring_bytes_per_stage, perLayer),
        el("td", {}, ""),
      ),
    );
    const times = typeof atOne === "string" ? 0 : atOne.saved_bytes_per_stage / found.saved_bytes_per_stage;
    const before = times ? `at CP 1: ${human(atOne.saved_bytes_per_stage)}, ${+times.toFixed(2)} times as much` : "";
    body.append(
      el(
        "tr",
        { class: "scale-calculator__total" },
        el("th", {}, `attention activations saved, the stage's ${layers} layers`),
        el("td", {}, ""),
        bytesCell("cp", "saved_bytes_per_stage", found.saved_bytes_per_stage, before),
        el("td", {}, ""),
      ),
    );
    const table = el("table", { class: "scale-calculator__table" }, el("thead", {}, head), body);
    return el("div", { class: "scale-calculator__scroll" }, table);
  }

  function cpSummary(chosen) {
    const world = ["tp", "cp", "pp", "dp"].map((g) => Number(chosen[g])).reduce((a, b) => a * b, 1);
    return el(
      "p",
      {},
      `${chosen.model} on TP ${chosen.tp} × CP ${chosen.cp} × PP ${chosen.pp} × DP ${chosen.dp} = `,
      `${world.toLocaleString("en-US")} GPUs: one layer's causal ring attention, head-tail balanced, on one cp `,
      "rank, forward and backward, and its pipeline stage's totals. The calculator gives the TP, PP and DP bytes ",
      "at CP 1 only: set CP to 1 for them.",
    );
  }

  function show(root, grid) {
    const form = root.querySelector("form");
    const chosen = setting(form);
    const atCP = chosen.cp !== "1";
    const found = atCP ? cpLookup(grid, chosen) : lookup(grid, chosen);
    const run = el(
      "div",
      {},
      el("p", {}, "The same layout, traced (from the repository root, after make setup):"),
      el("pre", { class: "scale-calculator__command" }, commandLine(command(form))),
    );
    const result = root.querySelector(".scale-calculator__result");
    if (typeof found === "string") {
      const refusal = `python -m reference.measure.scale refuses this layout: ${found}.`;
      result.replaceChildren(el("p", { class: "scale-calculator__refusal" }, refusal), run);
    } else if (atCP) {
      const atOne = grid.cp.entries[key(grid.cp, { ...chosen, cp: "1" })];
      result.replaceChildren(cpSummary(chosen), cpTable(found, atOne), run);
    } else {
      result.replaceChildren(summary(chosen, found.bubble), table(found.stages, Number(chosen.pp)), run);
    }
  }

  function start() {
    for (const root of document.querySelectorAll(".scale-calculator:not([data-ready])")) {
      root.dataset.ready = "";
      const grid = root.scaleGrid; // set by the script element inside it, which runs first
      const form = root.querySelector("form");
      form.addEventListener("change", () => show(root, grid));
      form.addEventListener("submit", (event) => event.preventDefault());
      show(root, grid);
    }
  }

  window.scaleCalculator = { human, lookup, cpLookup }; // for tests/site/test_browser.py
  if (typeof document$ !== "undefined") document$.subscribe(start); // material: every page it shows
  else if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
