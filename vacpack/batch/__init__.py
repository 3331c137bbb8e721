"""File jobs: OpenAI batch files (`vacpack run-batch -i requests.jsonl -o results.jsonl`) and
prompt files (`vacpack generate --input prompts.jsonl --output results.jsonl`).

Modules: options (the flags), lines (reading and checking input lines), records (output lines),
result_file (what an earlier run answered; durable appends are vacpack/output_file.py), runner
(feeding the engine), prompt_file (generate over a prompt file). Requests are translated and
checked by vacpack.openai_api, exactly as the HTTP server does.
"""
