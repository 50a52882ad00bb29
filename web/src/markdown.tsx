// A small Markdown renderer for agents' replies: fenced code blocks,
// headings, bullet and numbered lists, paragraphs, and inline code, bold,
// italic and links. It builds elements, never HTML from text, so whatever
// an agent writes (`<img onerror=...>` included) shows as text; links are
// http(s) only and open in a new tab without the opener.
import type { ComponentChildren } from "preact";

const INLINE = /(`[^`\n]+`)|(\*\*[^*\n]+\*\*)|(\*[^*\s][^*\n]*\*)|(\[[^\]\n]+\]\((https?:\/\/[^)\s]+)\))/;

function inline(text: string): ComponentChildren[] {
  const out: ComponentChildren[] = [];
  let rest = text;
  for (let guard = 0; rest && guard < 10_000; guard++) {
    const m = INLINE.exec(rest);
    if (!m) {
      out.push(rest);
      break;
    }
    if (m.index > 0) out.push(rest.slice(0, m.index));
    const [whole, code, bold, em, link, href] = m;
    if (code) out.push(<code>{code.slice(1, -1)}</code>);
    else if (bold) out.push(<strong>{inline(bold.slice(2, -2))}</strong>);
    else if (em) out.push(<em>{inline(em.slice(1, -1))}</em>);
    else if (link && href)
      out.push(
        <a href={href} target="_blank" rel="noopener noreferrer">
          {link.slice(1, link.indexOf("]("))}
        </a>,
      );
    rest = rest.slice(m.index + whole.length);
  }
  return out;
}

/** Renders `text` as Markdown blocks. */
export function Markdown(props: { text: string }) {
  const lines = props.text.split("\n");
  const blocks: ComponentChildren[] = [];
  let para: string[] = [];
  const flush = () => {
    if (para.length) blocks.push(<p>{inline(para.join("\n"))}</p>);
    para = [];
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = /^```\s*([\w+-]*)\s*$/.exec(line);
    if (fence) {
      flush();
      const code: string[] = [];
      for (i++; i < lines.length && !/^```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      blocks.push(
        <pre class="code" tabIndex={0} data-lang={fence[1] || undefined}>
          <code>{code.join("\n")}</code>
        </pre>,
      );
      continue;
    }
    const heading = /^(#{1,6})\s+(.*)$/.exec(line);
    if (heading) {
      flush();
      blocks.push(<p class={`md-h md-h${heading[1].length}`}>{inline(heading[2])}</p>);
      continue;
    }
    const item = /^\s*(?:[-*]|(\d+)\.)\s+(.*)$/.exec(line);
    if (item) {
      flush();
      const ordered = item[1] !== undefined;
      const items: string[] = [item[2]];
      while (i + 1 < lines.length) {
        const next = /^\s*(?:[-*]|(\d+)\.)\s+(.*)$/.exec(lines[i + 1]);
        if (!next || (next[1] !== undefined) !== ordered) break;
        items.push(next[2]);
        i++;
      }
      const lis = items.map((t) => <li>{inline(t)}</li>);
      blocks.push(ordered ? <ol>{lis}</ol> : <ul>{lis}</ul>);
      continue;
    }
    if (line.trim() === "") flush();
    else para.push(line);
  }
  flush();
  return <div class="md">{blocks}</div>;
}
