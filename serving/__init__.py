"""The serving subsystem: the engine, its scheduler, the OpenAI protocol and the HTTP gate."""
