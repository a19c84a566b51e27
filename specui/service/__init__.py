"""The chat service: what the CLI, the web page and the API call.

pair.py loads a target/draft pair with its heads into an engine; chat_service.py turns chat
messages and settings into generations on it; batch_loop.py decodes every tab's EMS-SD chats
as one continuous batch; runner.py runs model work on the main thread for the web app.

It sits above the engine, the model preparation (weights/) and the chat templates (chat.py),
and below the interfaces (cli.py, webapp.py, ui/, bench/)."""
