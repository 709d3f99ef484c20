#!/usr/bin/env node
// Reference tiktoken ids from the npm package gpt-tokenizer (a JavaScript port of OpenAI's tiktoken).
// Usage: node tiktoken_encode.js ENCODING INPUT..., ENCODING = r50k_base | p50k_base | cl100k_base |
// o200k_base; prints the ranks of each INPUT (read as UTF-8), space-separated, one line per input. The
// package is looked up in $LOOM_NODE_MODULES, by default this repo's data/npm/node_modules.
// Special-token text in the input is encoded as ordinary text (tiktoken's encode_ordinary).
'use strict';
const path = require('path');
const fs = require('fs');

const [encoding, ...inputs] = process.argv.slice(2);
if (!encoding || inputs.length === 0) {
  process.stderr.write('usage: node tiktoken_encode.js ENCODING INPUT...\n');
  process.exit(2);
}
const modules = process.env.LOOM_NODE_MODULES || path.join(__dirname, '..', '..', 'data', 'npm', 'node_modules');
const api = require(path.join(modules, 'gpt-tokenizer', 'cjs', 'encoding', encoding + '.js'));
for (const input of inputs) {
  const ids = api.encode(fs.readFileSync(input, 'utf8'), { disallowedSpecial: new Set() });
  process.stdout.write(ids.join(' ') + '\n');
}
