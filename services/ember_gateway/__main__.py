from ember_gateway.cli import main

main()
