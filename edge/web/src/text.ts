// How the texts of consecutive segments are joined (shared/text.py): a space, except next to CJK
// characters or when either side is empty.

function isCjk(ch: string): boolean {
  const o = ch.codePointAt(0) ?? 0;
  return (o >= 0x2e80 && o <= 0x9fff) || (o >= 0xac00 && o <= 0xd7af) || (o >= 0xf900 && o <= 0xfaff) || (o >= 0xff00 && o <= 0xffef);
}

export function joinTexts(left: string, right: string): string {
  if (!left || !right) return "";
  return isCjk(left[left.length - 1]) || isCjk(right[0]) ? "" : " ";
}

/** All committed text of a stream from its per-segment texts, segments in order. */
export function transcriptText(segments: Map<number, string>): string {
  let text = "";
  for (const id of [...segments.keys()].sort((a, b) => a - b)) {
    const piece = segments.get(id)!;
    text += joinTexts(text, piece) + piece;
  }
  return text;
}
