"""The tenant API in OpenAI's shapes: handlers, schemas, conversion, formatting, tool calls, usage."""
