#!/usr/bin/env node
// Reference pre-tokenizer: splits a UTF-8 file with the original regex of a pattern (JavaScript's
// engine, same leftmost-first backtracking as Python `regex` and fancy-regex) and prints the byte length
// of each piece, space-separated, one line per input. Usage: node regex_split.js PATTERN INPUT...,
// PATTERN = gpt2 | cl100k | megatron_v1 | megatron_v2. Two adaptations keep the reference exact: JavaScript's \s is not Unicode
// White_Space (it has U+FEFF and lacks U+0085), so \s / \S are written out as the White_Space set; and
// cl100k's (?i:...) is expanded with simple case folding (s also matches U+017F). Megatron v1's
// possessive ?+ and ++ are dropped: neither can change a match there (see tokenizers_impl.h).
'use strict';
const fs = require('fs');

const WS = '\\t\\n\\v\\f\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000';
const s = `[${WS}]`, S = `[^${WS}]`, notSLN = `[^${WS}\\p{L}\\p{N}]`;
const patterns = {
  gpt2: `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?${notSLN}+|${s}+(?!${S})|${s}+`,
  cl100k: `'(?:[sS\\u017f]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|` +
          ` ?${notSLN}+[\\r\\n]*|${s}*[\\r\\n]+|${s}+(?!${S})|${s}+`,
  megatron_v1: `[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?${notSLN}+[\\r\\n]*|${s}*[\\r\\n]|${s}+(?!${S})|${s}+`,
  megatron_v2: `[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|` +
               `[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}|` +
               ` ?${notSLN}+[\\r\\n/]*|${s}*[\\r\\n]+|${s}+(?!${S})|${s}+`,
};
const [name, ...inputs] = process.argv.slice(2);
if (!patterns[name] || inputs.length === 0) {
  process.stderr.write('usage: node regex_split.js gpt2|cl100k|megatron_v1|megatron_v2 INPUT...\n');
  process.exit(2);
}
const re = new RegExp(patterns[name], 'gu');
for (const input of inputs) {
  const text = fs.readFileSync(input, 'utf8');
  const lens = [];
  let covered = 0;
  for (const m of text.matchAll(re)) {
    if (m.index !== covered) throw new Error(`gap before offset ${m.index}`);
    covered += m[0].length;
    lens.push(Buffer.byteLength(m[0], 'utf8'));
  }
  if (covered !== text.length) throw new Error('pieces do not cover the text');
  process.stdout.write(lens.join(' ') + '\n');
}
