"""Parts shared by the models: embeddings and the language-model base class."""
