#!/usr/bin/env node
// Reference GPT-2 token ids from the npm package gpt-3-encoder (a JavaScript port of OpenAI's GPT-2
// encoder.py). Usage: node gpt2_encode.js INPUT...; prints the ids of each INPUT (read as UTF-8),
// space-separated, one line per input. The package is looked up in $LOOM_NODE_MODULES, by default this
// repo's data/npm/node_modules (scripts/setup.sh installs it there).
// gpt-3-encoder's encode() appends with Array.concat, which is quadratic in the number of tokens, so
// the text is encoded in chunks cut just before a space that sits between two non-space characters:
// no regex match crosses such a cut (the space starts the next word, and the regex looks only ahead of
// the space), so the concatenated ids equal encode(text).
'use strict';
const fs = require('fs');
const path = require('path');

const inputs = process.argv.slice(2);
if (inputs.length === 0) {
  process.stderr.write('usage: node gpt2_encode.js INPUT...\n');
  process.exit(2);
}
const modules = process.env.LOOM_NODE_MODULES || path.join(__dirname, '..', '..', 'data', 'npm', 'node_modules');
const { encode } = require(path.join(modules, 'gpt-3-encoder'));

function encodeAll(text) {
  const ids = [];
  const kChunk = 2000;  // characters (UTF-16 units) per chunk, roughly
  let start = 0;
  while (start < text.length) {
    let end = Math.min(text.length, start + kChunk);
    // move `end` to a ' ' with non-whitespace on both sides, or to the end of the text
    while (end < text.length &&
           !(text[end] === ' ' && end + 1 < text.length && /\S/.test(text[end - 1]) && /\S/.test(text[end + 1]))) {
      end++;
    }
    for (const id of encode(text.slice(start, end))) ids.push(id);
    start = end;
  }
  return ids;
}

for (const input of inputs) process.stdout.write(encodeAll(fs.readFileSync(input, 'utf8')).join(' ') + '\n');
