"""The runtime's network model: which link a transfer takes, how links are shared and scheduled, and the clock that paces them."""
