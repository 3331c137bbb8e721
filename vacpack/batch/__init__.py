"""OpenAI batch files: `vacpack run-batch -i requests.jsonl -o results.jsonl --model M`.

Modules: options (the flags), lines (reading and checking input lines), records (output lines),
result_file (resume, repair, durable appends), runner (feeding the engine). Requests are
translated and answered by vacpack.openai_api, exactly as the HTTP server answers them.
"""
