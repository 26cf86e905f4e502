"""What every Tandem process shares below the wire: the environment variables the code reads
(``env``), the contract between a process and its children (``processes``) and the event loop
asyncio processes run on (``event_loop``). It imports nothing from the other packages."""
