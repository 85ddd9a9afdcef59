"""The batch APIs: OpenAI's Files and Batches (``openai_files``) and Anthropic's Message
Batches (``message_batches``), with what both check of a batch's lines (``checks``),
over the store and runner of ``router.batches``.
"""
