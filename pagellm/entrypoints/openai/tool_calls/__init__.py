"""Function calling: the text formats models write calls in (parsers, whole and streamed), the
grammar that makes a model write a valid call, and the chat template that shows it the tools."""
