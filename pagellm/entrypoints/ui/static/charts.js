// Small hand-written SVG time-series charts: a title, the latest values, one polyline per series.

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 300, HEIGHT = 64;

export class Chart {
  // series: [{ label, colour, format }]; fixedMax: a fixed top of the scale (e.g. 1 for a fraction).
  constructor(parent, title, series, { points = 240, fixedMax = null, format = (v) => v.toFixed(1) } = {}) {
    this.series = series;
    this.points = points;
    this.fixedMax = fixedMax;
    this.format = format;
    this.values = series.map(() => []);
    const box = document.createElement("div");
    box.className = "chart";
    const head = document.createElement("div");
    head.className = "chart-head";
    head.innerHTML = `<span class="chart-title"></span><span class="chart-values"></span>`;
    head.firstChild.textContent = title;
    this.valuesBox = head.lastChild;
    this.svg = document.createElementNS(SVG, "svg");
    this.svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
    this.svg.setAttribute("preserveAspectRatio", "none");
    this.lines = series.map((s) => {
      const line = document.createElementNS(SVG, "polyline");
      line.setAttribute("fill", "none");
      line.setAttribute("stroke", s.colour);
      line.setAttribute("stroke-width", "1.5");
      line.setAttribute("vector-effect", "non-scaling-stroke");
      this.svg.appendChild(line);
      return line;
    });
    box.append(head, this.svg);
    parent.appendChild(box);
  }

  // One sample per series (null: no value this time).
  push(sample) {
    sample.forEach((v, k) => {
      const values = this.values[k];
      values.push(v);
      if (values.length > this.points) values.shift();
    });
    this.render();
  }

  render() {
    let max = this.fixedMax;
    if (max === null) {
      max = 0;
      for (const values of this.values) for (const v of values) if (v !== null && v > max) max = v;
      max = max > 0 ? max * 1.15 : 1;
    }
    this.values.forEach((values, k) => {
      const offset = this.points - values.length;
      const coords = [];
      values.forEach((v, i) => {
        if (v === null) return;
        const x = ((offset + i) / (this.points - 1)) * WIDTH;
        const y = HEIGHT - 2 - (Math.min(v, max) / max) * (HEIGHT - 4);
        coords.push(`${x.toFixed(1)},${y.toFixed(1)}`);
      });
      this.lines[k].setAttribute("points", coords.join(" "));
    });
    this.valuesBox.innerHTML = this.series
      .map((s, k) => {
        const last = this.values[k][this.values[k].length - 1];
        const text = last === null || last === undefined ? "–" : (s.format || this.format)(last);
        return `<span style="color:${s.colour}">${s.label} ${text}</span>`;
      })
      .join(" ");
  }
}
