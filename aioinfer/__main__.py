from aioinfer.cli import main

main()
