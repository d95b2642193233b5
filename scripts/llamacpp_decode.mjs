// Single-stream greedy decode through llama.cpp (the node-llama-cpp npm package's prebuilt CPU build).
//
//   NODE_PATH=/path/to/node_modules node scripts/llamacpp_decode.mjs MODEL.gguf THREADS TOKENS "PROMPT" [REPEATS] [CONTEXT]
//
// Prints one JSON line: decode tokens/s of each run (tokens after the first / time after the first),
// the generated token ids of the last run, and the prompt's token count. Nothing is sampled: temperature 0.
// CONTEXT (default 1024) is the context size: at least the prompt's tokens plus TOKENS.
import { createRequire } from "node:module";
import path from "node:path";

const require = createRequire(path.join(process.env.NODE_PATH || process.cwd(), "x.js"));
const { getLlama, LlamaContextSequence } = await import(require.resolve("node-llama-cpp"));

const [modelPath, threads, tokens, prompt, repeats = "3", contextSize = "1024"] = process.argv.slice(2);
const llama = await getLlama({ gpu: false, build: "never" });
const model = await llama.loadModel({ modelPath, gpuLayers: 0 });
const context = await model.createContext({ contextSize: Number(contextSize), threads: Number(threads), batchSize: 512 });
const promptIds = model.tokenize(prompt, true);

async function once(n) {
  const seq = context.getSequence();
  const ids = [];
  let first = null;
  const start = performance.now();
  for await (const id of seq.evaluate(promptIds, { temperature: 0 })) {
    if (first === null) first = performance.now();
    ids.push(id);
    if (ids.length >= n) break;
  }
  const end = performance.now();
  seq.dispose();
  return { ids, ttft_ms: first - start, decode_tok_s: (ids.length - 1) / ((end - first) / 1000) };
}

await once(4); // warm-up
const runs = [];
for (let i = 0; i < Number(repeats); i++) runs.push(await once(Number(tokens)));
console.log(JSON.stringify({
  threads: Number(threads), prompt_tokens: promptIds.length,
  decode_tok_s: runs.map((r) => r.decode_tok_s), ttft_ms: runs.map((r) => r.ttft_ms),
  token_ids: runs[runs.length - 1].ids,
}));
process.exit(0);
