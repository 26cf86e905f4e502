"""What every Tandem process shares below the wire: the environment variables the code reads
(``env``), the contract between a process and its children (``processes``), the event loop
asyncio processes run on (``event_loop``) and a model folder's tokenizer for the processes that
need only that (``hf_tokenizer``). It imports nothing from the other packages."""
